"""The tiny policies shipped in gradlab/data, and the error when an install lacks one.

Torch-free: the command line checks them before any work (`check_shipped_policy`), and
`load_policy` refuses to stand in a freshly warm-started policy for a missing shipped one (a
new warm start takes seconds to minutes and gives other weights than the shipped ones, which
the reproduction references were made with).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # gradlab/data
DEFAULT_POLICY_DIR = DATA_DIR / "default_policy"
SCAFFOLD_POLICY_DIR = DATA_DIR / "scaffold_policy"
# What `load_policy` reads from a shipped folder (generation_config.json and gradlab_info.json
# are records, not needed to load).
POLICY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# task key → (folder, the command that regenerates it: loop/setup/policy.py)
SHIPPED_POLICIES: dict[str, tuple[Path, str]] = {
    "arithmetic-d2": (DEFAULT_POLICY_DIR, "python -m gradlab.loop.setup.policy"),
    "scaffold-t4": (SCAFFOLD_POLICY_DIR, 'python -c "from gradlab.loop.setup.policy import '
                                         'make_scaffold_policy as m; m()"'),
}


class MissingPolicyError(FileNotFoundError):
    """A shipped policy file is missing from this install (the CLI: one line, exit code 2)."""


def check_shipped_policy(key: str = "arithmetic-d2") -> None:
    """MissingPolicyError naming the first missing file of the shipped policy for task `key`
    and how to restore it; nothing for a task without a shipped policy."""
    if key not in SHIPPED_POLICIES:
        return
    folder, regenerate = SHIPPED_POLICIES[key]
    for name in POLICY_FILES:
        path = folder / name
        if not path.is_file():
            raise MissingPolicyError(
                f"{path} is missing: the shipped policy of task {key} is incomplete in this "
                f"install; restore it from your gradlab clone (`git checkout -- gradlab/data/{folder.name}`, "
                f"then `pip install .` again unless gradlab was installed with -e) or "
                f"regenerate it (`{regenerate}`)")
