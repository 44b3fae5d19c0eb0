"""should_checkpoint(step): a checkpoint the coordinator asks for outside
the program's own schedule (aidnctl pause, a Slurm allocation about to
end). Every rank gets True at the same step: the ranks agree on it through
their progress beats, each waiting at the step until all are there."""

import logging

from . import _job

log = logging.getLogger("aidn")

# How long a rank waits at the step for the others to agree before it says
# it missed the step and trains on (a job whose ranks all wait this long has
# long failed its progress timeout).
_WAIT_SECONDS = 600.0


def should_checkpoint(step) -> bool:
    """Call after aidn.report(step), every step: True when the coordinator
    asks for a checkpoint after step `step` (a pause). Save one then, as at
    your own checkpoint steps (rank 0, or every rank its shard, under
    `with aidn.checkpoint(step)`); the job stops once it is committed
    (aidn.should_stop() turns True) and resumes from it. At that step the
    call may wait, for a second or so, until every rank is there."""
    job = _job.current()
    if job.env is None:
        job.warn_not_under_aidn("should_checkpoint()")
        return False
    reporter = job.reporter_if_started()
    if reporter is None:  # no report() yet: no beats, so no asks
        return False
    # Answers an ask not yet answered (the reporter answers those that
    # arrive after the first boundary itself).
    ask_step, go = reporter.at_step_boundary(step)
    if ask_step == 0 or step != ask_step:
        return False
    if go:
        return True
    log.info("aidn: waiting at step %d, the checkpoint step asked for, until every rank is there",
             step)
    ask_step, go = reporter.await_checkpoint_go(ask_step, _WAIT_SECONDS)
    if ask_step == step and go:
        return True
    if ask_step == step:
        log.warning("aidn: no agreement on the checkpoint step %d; training on", step)
        reporter.answer_checkpoint_ask(step, missed=True)
        return False
    # Another step (a rank had passed this one; the reporter acked it) or the
    # generation's end.
    return False
