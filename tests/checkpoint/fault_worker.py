"""``lockstep`` CLI whose local checkpoint storage has a byte quota: a full disk, without root or tmpfs.

``LOCKSTEP_TEST_DISK_QUOTA=N python fault_worker.py train ...`` runs ``lockstep train ...`` with every
local checkpoint storage replaced by :class:`QuotaStorage`: once the files under the storage root and
a new file would pass N bytes, the file's write stops part-way with ``ENOSPC``, as a full disk's does
(``LocalStorage.put`` runs its own clean-up). The background writer process receives the storage
pickled, so it fails the same way. Used by tests/checkpoint/test_fault_injection.py.
"""

from __future__ import annotations

import errno
import os
import sys

from lockstep.checkpoint.storage import LocalStorage


class QuotaStorage(LocalStorage):
    def __init__(self, root, quota: int) -> None:
        super().__init__(root)
        self.quota = quota

    def _used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.root) for f in files)

    def put(self, key, chunks) -> None:
        room = self.quota - self._used()
        if sum(len(c) for c in chunks) <= room:
            return super().put(key, chunks)

        def until_full():
            left = max(room, 0)
            for chunk in chunks:
                piece = bytes(chunk)[:left]
                left -= len(piece)
                yield piece
                if left <= 0:
                    break
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        super().put(key, until_full())


def main() -> int:
    import lockstep.checkpoint.storage as storage_module
    from lockstep.cli import main as cli_main

    quota = os.environ.get("LOCKSTEP_TEST_DISK_QUOTA")
    if quota:
        real = storage_module.storage_from_uri

        def storage_from_uri(uri: str, *, endpoint_url: str = ""):
            built = real(uri, endpoint_url=endpoint_url)
            return QuotaStorage(built.root, int(quota)) if isinstance(built, LocalStorage) else built

        storage_module.storage_from_uri = storage_from_uri
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
