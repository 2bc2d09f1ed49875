"""What is written down or crosses a process, each with one writer and one reader: the correction record
and its binary encoding (`record.py`), an adapter version's directory (`adapters.py`) and its metadata
file (`adapter_metadata.py`), per-request stats (`stats.py`), the trainer's status (`status.py`)."""
