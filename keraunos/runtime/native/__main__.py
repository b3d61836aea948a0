"""``python -m keraunos.runtime.native``: build the native hit path now (``scripts/setup.sh`` does), and
say where it is and how long it took; exit status 1 when it cannot be built."""
import sys
import time

from . import build, cache_directory

if __name__ == "__main__":
    start = time.perf_counter()
    try:
        path = build()
    except Exception as e:  # noqa: BLE001 - reported; keraunos then uses the Python hit path
        print(f"keraunos: the native hit path could not be built in {cache_directory()}: {e}")
        sys.exit(1)
    print(f"keraunos: native hit path {path} ({time.perf_counter() - start:.1f} s)")
