"""Weights from the trainer to the serving endpoints: one seam, `WeightSync`.

    sync = FolderSync(write=trainer.save_weights, root=out / "weights", keep=3,
                      pool=pool, kind="embedded", origin=Weights(0, str(start)))
    seconds = await sync.publish(version)      # the training loop calls nothing else

A transport has two halves: the trainer side produces version `v` (writes a folder,
or, with a broadcast transport, sends its tensors) and the endpoint side takes it in
(loads the folder, or receives the tensors). `publish` runs both, so a transport whose
sender blocks until the receivers join (NCCL) fits the same call. The same object owns
which endpoints receive weights: an engine that starts is brought to the current
version before it is registered (`attach`), one that stops is drained and removed
under the same lock (`detach`), so no turn is ever stamped with a version its endpoint
does not hold.

Modules: `base` (the protocol, `Weights`), `folder` (`FolderSync`: versioned HF folders
on a filesystem every endpoint sees), `broadcast` (`BroadcastSync`: tensors from the
trainer's memory over one gloo group per server, through vLLM's weight-transfer
phases; `libra.transfer` is its torch half).
"""

from libra.weights.base import Weights, WeightSync
from libra.weights.broadcast import BroadcastSync, Sender
from libra.weights.folder import FolderSync, prune, version_dir

__all__ = ["BroadcastSync", "FolderSync", "Sender", "WeightSync", "Weights", "prune",
           "version_dir"]  # fmt: skip
