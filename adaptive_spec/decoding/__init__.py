"""The decoding loop: a batch of rows and its step, draft -> verify -> accept -> commit (`batch.py`);
each row's record (`row.py`), a request and its trace (`request.py`), checked requests (`requests.py`),
chunked prefill (`prefill.py`), and how many tokens to draft at each step (`dynamic_k.py` over the
measured costs of `estimates.py`)."""
