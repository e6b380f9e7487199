"""Helpers of scripts/check_newest_transformers.sh (standard library only: it runs before any environment exists).

python3 scripts/newest_transformers.py newer  < "pip index versions transformers" output
    prints the newest stable transformers release the index lists if it is beyond setup.cfg's upper pin
    (``transformers>=5.23,<5.25``: 5.25.0 or later), else nothing
python3 scripts/newest_transformers.py newest < the same
    prints the newest stable release, pinned or not
python3 scripts/newest_transformers.py requirements
    prints setup.cfg's install_requires and test extra without transformers, one a line (the throw-away
    environment installs them beside the unpinned transformers)
"""

import configparser
import re
import sys
from pathlib import Path


SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
STABLE = re.compile(r"^\d+(\.\d+)*$")


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def listed_versions(pip_index_output: str) -> list[str]:
    """The stable versions of ``pip index versions`` output ("Available versions: 5.24.0, 5.23.0, ..."); pre-releases
    (``5.25.0rc1``, ``.dev0``) are left out."""
    match = re.search(r"^Available versions:(.*)$", pip_index_output, re.M)
    if match is None:
        raise ValueError(f"no 'Available versions:' line in pip's output: {pip_index_output.strip()[:200]!r}")
    return [v for v in (part.strip() for part in match.group(1).split(",")) if STABLE.match(v)]


def requirements(setup_cfg: Path = SETUP_CFG) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    lines = cfg["options"]["install_requires"].split("\n") + cfg["options.extras_require"]["test"].split("\n")
    return [line.strip() for line in lines if line.strip()]


def upper_pin(setup_cfg: Path = SETUP_CFG) -> str:
    """The ``<X`` bound of setup.cfg's transformers requirement."""
    spec = next((r for r in requirements(setup_cfg) if re.match(r"transformers\b", r)), None)
    match = re.search(r"<\s*([\d.]+)", spec or "")
    if match is None:
        raise ValueError(f"setup.cfg's transformers requirement has no upper pin: {spec!r}")
    return match.group(1)


def newer_release(versions: list[str], upper: str) -> str | None:
    """The newest of ``versions`` if setup.cfg's ``<upper`` excludes it, else None."""
    newest = max(versions, key=release, default=None)
    return newest if newest is not None and release(newest) >= release(upper) else None


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command in ("newer", "newest"):
        versions = listed_versions(sys.stdin.read())
        found = newer_release(versions, upper_pin()) if command == "newer" else max(versions, key=release)
        print(found or "")
    elif command == "requirements":
        print("\n".join(r for r in requirements() if not re.match(r"transformers\b", r)))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
