"""A replica's failures as the engine's process sees them: the error it raises for a request or an operation that
failed on a replica, and the partial video a replica killed mid-write left behind."""

from __future__ import annotations

import logging
import typing

from k6serve.lora.spec import LoraOperation, LoraReply, ReplicasDisagree
from k6serve.runtime import messages

# The engine side's name: these lines were logged under it when the functions lived in process_group_worker.py
# (log filters, saved logs).
logger = logging.getLogger("k6serve.runtime.process_group_worker")


class RemoteTraceback(Exception):
    """The traceback of an error raised in a worker process, attached as the re-raised error's cause."""


def failure_error(message: messages.RunFailed, request_id: int, replica: int) -> Exception:
    """The exception the engine raises for a request that failed on a replica (not cancelled)."""
    if message.kind == "value":
        return message.error if message.error is not None else ValueError(message.message)
    if message.kind in ("os", "module") and message.error is not None:
        # An OSError (disk full, permission) or a missing package stays one, so callers can tell it from a bug.
        message.error.__cause__ = RemoteTraceback(message.message)
        return message.error
    return RuntimeError(f"request {request_id} failed on replica {replica}: {message.message}")


def lora_result(operation: LoraOperation, outcomes: list[tuple[int, LoraReply | Exception]]) -> LoraReply:
    """The first replica's reply when all succeeded, else the error to raise (see `apply_lora_operation`)."""
    failed = [(index, error) for index, error in outcomes if isinstance(error, Exception)]
    if not failed:
        return typing.cast(LoraReply, outcomes[0][1])
    succeeded = [index for index, result in outcomes if not isinstance(result, Exception)]
    index, error = failed[0]
    if not succeeded:
        raise error
    raise ReplicasDisagree(
        f"{type(operation).__name__} succeeded on replica(s) {succeeded} but failed on replica(s) "
        f"{[i for i, _ in failed]}, so the replicas now hold different LoRA adapters; repeat the operation, or "
        f"call unmerge_lora_weights, to make them agree. Replica {index}: {type(error).__name__}: {error}"
    ) from error


def remove_dead_writers_files(folder: str, pids: tuple[int, ...]) -> None:
    """The partial MP4 a replica killed mid-write left (its leader writes the video;
    `MultiProcessWorker._replica_died` has stopped the replica by now). The server sweeps such files at start; the CLI
    and the API never did, so each kill by the out-of-memory killer left a hidden file of up to tens of MB in the
    user's output folder."""
    from k6serve.media.output_names import remove_partial_files

    for pid in pids:
        try:
            for path in remove_partial_files(folder, pid):
                logger.info("removed %s, the partial video of the rank that died", path)
        except OSError as exc:
            logger.warning("could not remove the dead rank's partial video in %s: %s", folder, exc)
