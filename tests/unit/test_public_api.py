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


def test_trainer_surface_and_its_errors() -> None:
    """`libra.trainer` exports its API and the trainer's errors, which sit in Libra's
    hierarchy (`Dropped` is the old name of `ReplicaDropped`)."""
    import libra.trainer as trainer
    from libra.errors import LibraError, ReplicaDropped, TrainerError

    assert sorted(trainer.__all__) == sorted(
        ["Dropped", "ElasticConfig", "ElasticTrainer", "GRPOConfig", "MembershipEvent",
         "OptimConfig", "ReplicaDropped", "ReplicaStatus", "Sample", "StepReport",
         "TrainerConfig", "TrainerError", "group_advantages", "prepare"]
    )  # fmt: skip
    for name in trainer.__all__:
        assert hasattr(trainer, name)
    assert trainer.TrainerError is TrainerError and trainer.Dropped is ReplicaDropped
    assert issubclass(ReplicaDropped, TrainerError) and issubclass(TrainerError, LibraError)
