"""What shapes a request's input and output: prompts checked and encoded (`tokens.py`), prompt files
(`prompts.py`), `response_format` grammars (`grammar.py`), a row's masks and penalties
(`constraints.py`), tool calls (`tools/`), and streamed text (`textstream.py`)."""
