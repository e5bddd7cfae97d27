"""Parallelism on torch.distributed, applied to models from outside: dims/mesh, FSDP2, TP/SP."""
