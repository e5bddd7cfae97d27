// lockstep::packed_linear and lockstep::packed_linear_cat as C++ CPU kernels (lockstep/ops/packed_op.py
// builds and loads this file; lockstep/generate/packed.py defines the ops' schemas and owns the packs).
//
// Why: a SmolLM2 decode step makes 121 packed-linear op calls; with a Python kernel behind the
// dispatcher each cost ~6-8 us besides the product (dispatcher -> Python -> ctypes). Here a call is a
// table lookup, a staleness check, an at::empty and the C kernel's call through its function pointer.
//
// Arithmetic: none of its own. The product is the C kernel packed.py registered for the entry
// (csrc/bf16_linear.c, amx_linear.c, f32_linear.c, resolved by lockstep.ops.decode_linear for the
// process's ISA level when the weight was packed), called with the very arguments decode_linear.linear
// passes it through ctypes: the same bits as the Python kernel.
//
// The table: key (the op's handle, or a sibling group's handle list) -> entry (packed weight, fp32 bias,
// output width, kernel function, and the weight/bias tensors the pack was made from, held weakly, with
// their version counters and data pointers at packing). An entry is used only while every source is
// alive and shows the same version and data pointer (an in-place write, copy_, `.data =` or the
// source's death since make it stale). A missing or stale entry, another dtype or a oneDNN pack go to
// lockstep::_packed_linear_py (the Python kernel, which repacks when the weights moved and registers
// the entry again). Entries are registered, forgotten and cleared through the ops at the bottom.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using Kernel = void (*)(const void *x, const void *packed, const float *bias, void *out, int64_t m, int64_t n,
                        int64_t k);
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Source {
  WeakImpl impl;
  int64_t version;
  const void *data;
};

struct Entry {
  at::Tensor packed, bias;  // bias: fp32 [N] or undefined
  int64_t out_features, in_features;
  at::ScalarType dtype;
  Kernel kernel;
  std::vector<Source> sources;
};

// never destroyed: entries hold tensors whose Python objects must not be released after the
// interpreter is gone (packed.py forgets entries while it runs)
std::map<std::vector<int64_t>, std::shared_ptr<const Entry>> &table() {
  static auto *t = new std::map<std::vector<int64_t>, std::shared_ptr<const Entry>>();
  return *t;
}
std::mutex table_mutex;

bool fresh(const Entry &e) {
  for (const Source &s : e.sources) {
    auto impl = s.impl.lock();
    if (!impl || impl->version_counter().current_version() != static_cast<uint32_t>(s.version) ||
        impl->data() != s.data)
      return false;
  }
  return true;
}

std::shared_ptr<const Entry> lookup(const std::vector<int64_t> &key) {
  std::lock_guard<std::mutex> guard(table_mutex);
  auto it = table().find(key);
  return it == table().end() ? nullptr : it->second;
}

at::Tensor python_kernel(const at::Tensor &x, c10::IntArrayRef handles) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lockstep::_packed_linear_py", "")
                       .typed<at::Tensor(const at::Tensor &, c10::IntArrayRef)>();
  return op.call(x, handles);
}

at::Tensor run(const at::Tensor &x, std::vector<int64_t> key) {
  auto entry = lookup(key);
  if (!entry || x.scalar_type() != entry->dtype || x.dim() == 0 || x.size(-1) != entry->in_features ||
      !fresh(*entry))
    return python_kernel(x, key);
  at::Tensor input = x.contiguous();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = entry->out_features;
  at::Tensor out = at::empty(shape, input.options());
  const int64_t rows = entry->out_features ? out.numel() / entry->out_features : 0;
  if (rows)
    entry->kernel(input.const_data_ptr(), entry->packed.const_data_ptr(),
                  entry->bias.defined() ? entry->bias.const_data_ptr<float>() : nullptr, out.mutable_data_ptr(), rows,
                  entry->out_features, entry->in_features);
  return out;
}

at::Tensor packed_linear(const at::Tensor &x, int64_t handle) { return run(x, {handle}); }

at::Tensor packed_linear_cat(const at::Tensor &x, c10::IntArrayRef handles) { return run(x, handles.vec()); }

void packed_register(c10::IntArrayRef key, const c10::List<std::optional<at::Tensor>> &sources,
                     const at::Tensor &packed, const std::optional<at::Tensor> &bias, int64_t out_features,
                     int64_t in_features, int64_t kernel) {
  TORCH_CHECK(kernel != 0, "lockstep::_packed_register: no kernel function");
  TORCH_CHECK(!bias || bias->scalar_type() == at::kFloat, "lockstep::_packed_register: the bias must be fp32");
  auto entry = std::make_shared<Entry>();
  entry->packed = packed;
  entry->bias = bias ? *bias : at::Tensor();
  entry->out_features = out_features;
  entry->in_features = in_features;
  entry->dtype = packed.scalar_type();
  entry->kernel = reinterpret_cast<Kernel>(kernel);
  for (const auto &item : sources) {
    std::optional<at::Tensor> t = item;
    if (!t || !t->defined())
      continue;
    const c10::TensorImpl *impl = t->unsafeGetTensorImpl();
    entry->sources.push_back({WeakImpl(t->getIntrusivePtr()), static_cast<int64_t>(impl->version_counter().current_version()),
                              impl->data()});
  }
  std::lock_guard<std::mutex> guard(table_mutex);
  table()[key.vec()] = std::move(entry);
}

void packed_forget(int64_t handle) {
  std::lock_guard<std::mutex> guard(table_mutex);
  for (auto it = table().begin(); it != table().end();) {
    bool has = false;
    for (int64_t h : it->first)
      has = has || h == handle;
    it = has ? table().erase(it) : std::next(it);
  }
}

int64_t packed_entries() {
  std::lock_guard<std::mutex> guard(table_mutex);
  return static_cast<int64_t>(table().size());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lockstep, m) {
  // catch-all kernels: bookkeeping, called outside autograd and tracing
  m.def("_packed_register(int[] key, Tensor?[] sources, Tensor packed, Tensor? bias, int out_features, "
        "int in_features, int kernel) -> ()",
        &packed_register);
  m.def("_packed_forget(int handle) -> ()", &packed_forget);
  m.def("_packed_entries() -> int", &packed_entries);
}

TORCH_LIBRARY_IMPL(lockstep, CPU, m) {
  m.impl("packed_linear", TORCH_FN(packed_linear));
  m.impl("packed_linear_cat", TORCH_FN(packed_linear_cat));
}
