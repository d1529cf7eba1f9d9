"""Error types. Anything derived from :class:`ContinuumLMError` is a user error: the CLI prints
its message as one paragraph and exits with status 2 (74 for a :class:`DiskError`), without a
traceback."""


class ContinuumLMError(Exception):
    """Base class of errors caused by input (config, data, checkpoint, prompt).

    ``collective`` marks an error that every process of a torchrun job raises with the same
    message (a bad config, a divergence decided on all-reduced values): only rank 0 prints it.
    """

    collective = False


class ConfigError(ContinuumLMError, ValueError):
    """A configuration value is wrong; the message names the key."""

    collective = True  # every rank reads the same files and --set values


class DataError(ContinuumLMError):
    """A corpus or tokenizer problem: missing file, bad checksum, undecodable bytes..."""


class CheckpointError(ContinuumLMError):
    """A checkpoint folder is missing, incomplete, corrupt or unsafe."""


class TrainingError(ContinuumLMError):
    """Training cannot go on (diverged, or a checkpoint could not be written); the last good
    checkpoint is kept."""


class OldSpelling(FutureWarning):
    """A config key spelled as an earlier version did: it still loads, under its new name. The
    CLI prints it as one line, ``note: ...``."""


# Exit statuses of `continuumlm train` that a job script tells apart (besides 0, finished):
USAGE_STATUS = 2      # bad input (config, data, checkpoint): fix it before running again
DISK_STATUS = 74      # a write failed (disk full, quota, read-only, I/O error): sysexits EX_IOERR
REQUEUE_STATUS = 75   # stopped by a scheduler's warning signal, checkpoint saved: requeue me
                      # (sysexits EX_TEMPFAIL); 130 / 143: stopped by SIGINT / SIGTERM, saved


class DiskError(TrainingError):
    """Writing a checkpoint or the metrics failed on the file system; the last complete
    checkpoint is intact."""

    exit_status = DISK_STATUS


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's can run to hundreds), else its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
