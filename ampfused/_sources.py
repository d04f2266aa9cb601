"""The hash of the ``csrc/`` folders each native module is built from. setup.py stamps it into the module (it loads
this file by path: the package itself imports torch) and ``ampfused._native`` compares it with the checkout's, so
a build older than its sources is refused with a message saying how to rebuild. Standard library only."""
import hashlib
import os

SOURCE_DIRS = {"cpu": ("cpu", "include"), "cuda": ("cuda", "include"), "host": ("host", "include")}
SUFFIXES = (".h", ".cuh", ".cpp", ".cu")


def sources_hash(csrc: str, kind: str) -> str:
    """Hash of the paths and contents of the sources under ``csrc`` that module ``kind`` is built from."""
    h = hashlib.sha256()
    for top in SOURCE_DIRS[kind]:
        for dirpath, dirnames, filenames in os.walk(os.path.join(csrc, top)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(SUFFIXES):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, csrc).replace(os.sep, "/").encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read() + b"\0")
    return h.hexdigest()[:16]
