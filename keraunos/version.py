"""The version of keraunos (its cache keys and reports name it), and the torch releases it is
tested on (``pyproject.toml`` declares the same range)."""
from __future__ import annotations

import warnings

__version__ = "0.1.0"

# Every torch release line the suite runs on (docs/compatibility.md). A torch outside them warns
# once at import: keraunos builds on torch's private machinery, which changes between releases.
TESTED_TORCH = ((2, 13), (2, 14), (2, 15))


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.15.0+cu132" -> (2, 15)); None if unreadable."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_torch(version: str) -> str | None:
    """Why ``version`` of torch is not one keraunos is tested on, or None when it is."""
    release = release_of(version)
    if release in TESTED_TORCH:
        return None
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    return (f"keraunos {__version__} is tested on torch {tested}; this is torch {version}. "
            f"keraunos uses torch's private machinery, which changes between releases: expect "
            f"errors or slower paths. Install a tested torch (pip install 'torch>=2.13,<2.16'), "
            f"or report what fails with this torch.")


def warn_if_untested() -> None:
    import torch
    why = check_torch(torch.__version__)
    if why is not None:
        warnings.warn(why, UserWarning, stacklevel=3)
