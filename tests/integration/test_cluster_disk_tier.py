"""Two replica proxies (examples/cluster/replica.yaml, tiny model) on one ``kv_disk_path``,
behind LiteLLM's Router with prefix-aware routing: when the replica that owns a prefix dies,
its sessions are rerouted to the other, which loads the prefix from the shared folder
instead of prefilling it. The real ``litellm`` CLI runs both (30-60 s to start on two busy
cores), so the test is ``slow``."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy_helpers import REPO, start_proxy, stop, wait_ready

pytestmark = pytest.mark.slow

ALIAS = "tiny"
IDS = ("rep-a", "rep-b")
SYSTEM = "You are the planning agent of team disk. " + " ".join(f"Rule {k}: check item {k} twice." for k in range(40))


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_a_session_rerouted_after_its_replica_dies_finds_its_prefix_on_the_shared_disk(tiny_model: Any, tiny_model_dir: Path,
                                                                                     tmp_path: Path) -> None:
    import litellm

    from mlx_parallm_provider.integrations.routing import PrefixAwareRouting

    shared = tmp_path / "kv"
    key = "sk-" + secrets.token_hex(16)
    config = yaml.safe_load((REPO / "examples" / "cluster" / "replica.yaml").read_text())
    config["model_list"] = [{"model_name": ALIAS, "litellm_params": {"model": f"mlx-parallm/{tiny_model_dir}"}}]
    engine = {"MLX_PARALLM_ENGINE_CONFIG": json.dumps({"kv_disk_path": str(shared), "kv_disk_gb": 1})}
    replicas = {rid: start_proxy(config, tmp_path / rid, key, engine, ("--keepalive_timeout", "75")) for rid in IDS}
    try:
        for proxy in replicas.values():
            wait_ready(proxy)
        router = litellm.Router(model_list=[
            {"model_name": ALIAS, "litellm_params": {"model": f"openai/{ALIAS}", "api_base": f"{replicas[rid].base_url}/v1", "api_key": key},
             "model_info": {"id": rid}} for rid in IDS], num_retries=2, allowed_fails=3, cooldown_time=30)
        PrefixAwareRouting().install(router)

        def ask(question: str) -> Any:
            return asyncio.run(router.acompletion(model=ALIAS, messages=_messages(question), max_tokens=8, temperature=0))

        first = ask("Which rule comes first?")
        owner = first._hidden_params["model_id"]
        other = next(rid for rid in IDS if rid != owner)
        prompt = len(tiny_model.tokenizer.apply_chat_template(_messages("Which rule comes first?"), add_generation_prompt=True, tokenize=True))
        deadline = time.monotonic() + 30
        while len(list(shared.glob("*.kvb"))) < prompt // 16 and time.monotonic() < deadline:
            time.sleep(0.05)  # (the owner writes its blocks behind its loop)
        assert len(list(shared.glob("*.kvb"))) >= prompt // 16

        os.kill(replicas[owner].process.pid, signal.SIGKILL)
        replicas[owner].process.wait(timeout=10)
        second = ask("Which rule comes last?")  # the same prefix: its owner is gone
        assert second._hidden_params["model_id"] == other
        assert second.choices[0].message.content is not None
        assert second.usage.prompt_tokens_details.cached_tokens >= (prompt // 16 - 1) * 16
        with replicas[other].client(timeout=10) as client:
            metrics = client.get("/metrics", follow_redirects=True).text
        from prometheus_client.parser import text_string_to_metric_families

        disk_hits = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                     if s.name == "mlx_parallm:prefix_cache_tier_hit_tokens_total" and s.labels.get("tier") == "disk"]
        assert disk_hits and disk_hits[0] >= (prompt // 16 - 1) * 16, metrics[-2000:]
    finally:
        for proxy in replicas.values():
            stop(proxy)
