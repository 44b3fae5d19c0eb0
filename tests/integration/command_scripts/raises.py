"""Fails the way a real script does: an exception under torch's @record,
which writes it to TORCHELASTIC_ERROR_FILE."""
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise ValueError("loss is nan at step 7")


if __name__ == "__main__":
    main()
