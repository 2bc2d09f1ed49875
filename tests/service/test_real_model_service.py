"""The service on the built-in default model (SmolLM2-135M-Instruct), loaded by the app's lifespan.

Run alone with: ./run tests -m real_model   (about 10 s once the model is cached as safetensors)

The tiny-model tests pass an engine in; this one checks the path `adaptive-spec serve` takes,
where the lifespan loads the models named in the settings, and that chat over HTTP through the
official client is the target alone's greedy text.
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.real_model


def test_chat_on_the_default_model_equals_the_target_alone(live_server):
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    with live_server(None, dtype="fp32", device="cpu", draft="early-exit:4") as server:
        engine = server.service.engine
        expected = engine.generate(messages, max_new_tokens=32, speculative=False)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        response = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=32, temperature=0
        )
        assert response.choices[0].message.content == expected.text
        spec = response.usage.model_extra["spec_decode"]
        assert response.usage.completion_tokens == len(expected.token_ids)
        assert spec["adapter_version"] is None and spec["mean_acceptance_length"] >= 1.0
        streamed = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=32, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected.text
