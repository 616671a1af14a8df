import subprocess
import sys

import libra


def test_public_surface() -> None:
    assert sorted(libra.__all__) == sorted(
        ["Context", "Env", "LibraError", "Tool", "ToolResult", "Trajectory", "__version__", "tool"]
    )
    for name in libra.__all__:
        assert hasattr(libra, name)


def test_import_is_light() -> None:
    """`import libra` and the rollout path start without torch or transformers."""
    code = (
        "import sys, libra, libra.rollout, libra.cli; "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
