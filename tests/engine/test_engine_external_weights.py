"""Tinker's external-weights export through the unmodified SDK: save_weights_external, signed file URLs."""

from __future__ import annotations

import http.client
import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from engine_proc import TINY, seq_gaps, start_engine
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from tinkerrpc_server.engine.signed_urls import Forbidden, check_file_signature, sign_file
from tinkerrpc_server.local.stack import LocalEngine

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([12, 40, 41, 7, 9]),
        loss_fn_inputs={
            "target_tokens": np.asarray([40, 41, 7, 9, 3]),
            "weights": np.ones(5, dtype=np.float32),
        },
    )
]
FILES_ROUTE = "/api/v1/external_weights_files"
# The brief's entry point to the REST API; the SDK now prefers tinker.RestClient(...) and warns.
pytestmark = [
    pytest.mark.process,
    pytest.mark.filterwarnings("ignore:.*create_rest_client.*:FutureWarning"),
]


def trained_model(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    """A LoRA client one optimizer step away from its initial (lora_B = 0) weights."""
    client = service.create_lora_training_client(TINY, rank=4, seed=seed).result()
    client.forward_backward(DATA, "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return client


def download(urls: dict[str, str], target: Path) -> None:
    for relative, url in urls.items():
        response = httpx.get(url, timeout=60)
        assert response.status_code == 200, (relative, response.status_code, response.text)
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_bytes(response.content)


def test_export_is_a_loadable_adapter_equal_to_the_sampler_weights(
    service: tinker.ServiceClient, engine: LocalEngine, tmp_path: Path
) -> None:
    client = trained_model(service, seed=4)
    client.save_weights_for_sampler("same-point").result()
    export = client.save_weights_external("exp1").result()
    assert export.path == f"tinker://{client.model_id}/external_weights/exp1"

    rest = service.create_rest_client()
    asked_at = datetime.now(timezone.utc)
    signed = rest.get_external_weights_urls(export.path).result()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(signed.urls)
    assert not any(name.startswith("optimizer") for name in signed.urls), signed.urls
    assert asked_at + timedelta(minutes=59) < signed.expires <= asked_at + timedelta(minutes=61)
    assert all(url.startswith(f"{engine.base_url}{FILES_ROUTE}/") for url in signed.urls.values())
    downloaded = tmp_path / "exp1"
    download(signed.urls, downloaded)

    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    sizes = sum(p.stat().st_size for p in downloaded.rglob("*") if p.is_file())
    assert listed[export.path].size_bytes == sizes

    exported = load_file(str(downloaded / "adapter_model.safetensors"))
    sampler_dir = engine.data_dir / "runs" / client.model_id / "sampler_weights" / "same-point"
    reference = load_file(str(sampler_dir / "adapter_model.safetensors"))
    assert exported.keys() == reference.keys() and exported
    for key, tensor in exported.items():
        assert torch.equal(tensor, reference[key]), key
    trained_b = [t for k, t in exported.items() if "lora_B" in k]
    assert trained_b and any(bool(t.any()) for t in trained_b), "lora_B starts at zero: a step must move it"

    base = AutoModelForCausalLM.from_pretrained(engine.model_dir / TINY, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(downloaded))
    loaded = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert loaded.keys() == exported.keys()
    for key, tensor in exported.items():
        assert torch.equal(loaded[key].float(), tensor.float()), key


def test_file_urls_are_signed_and_never_leave_the_export(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = trained_model(service, seed=6)
    path = client.save_weights_external("guarded").result().path
    rest = service.create_rest_client()
    urls = rest.get_external_weights_urls(path).result().urls
    config_url = httpx.URL(urls["adapter_config.json"])
    expires, signature = config_url.params["expires"], config_url.params["signature"]
    good = httpx.get(config_url)
    assert good.status_code == 200 and json.loads(good.content)["r"] == 4

    def status(url: httpx.URL | str, **params: str) -> int:
        return httpx.get(httpx.URL(url).copy_merge_params(params) if params else url).status_code

    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    assert status(config_url, signature=flipped) == 403
    assert status(config_url, expires=str(int(expires) + 3600)) == 403
    assert status(config_url.copy_remove_param("signature")) == 403
    # A valid signature is for one file only.
    weights_url = httpx.URL(urls["adapter_model.safetensors"]).copy_merge_params(
        {"expires": expires, "signature": signature}
    )
    assert status(weights_url) == 403

    prefix = f"{engine.base_url}{FILES_ROUTE}/{client.model_id}/guarded"
    query = f"expires={expires}&signature={signature}"
    for escape in ("..%2F..%2F..%2F..%2Fengine_index.jsonl", "%2Fetc%2Fpasswd", ".%2Fadapter_config.json"):
        response = httpx.get(f"{prefix}/{escape}?{query}")
        assert response.status_code == 404, (escape, response.text)
        assert "no file" in response.json()["detail"]
    # A client that sends '..' literally (no URL normalisation) gets the same answer.
    connection = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=30)
    connection.request(
        "GET", f"{FILES_ROUTE}/{client.model_id}/guarded/../../../../engine_index.jsonl?{query}"
    )
    raw = connection.getresponse()
    assert raw.status == 404 and b"checkpoints" not in raw.read()
    connection.close()

    # A symlink planted in the export is never followed, not even through a validly signed URL.
    export_dir = engine.data_dir / "runs" / client.model_id / "external_weights" / "guarded"
    (export_dir / "adapter_config.json").unlink()
    (export_dir / "adapter_config.json").symlink_to(engine.data_dir / "engine_index.jsonl")
    leaked = httpx.get(config_url)
    assert leaked.status_code == 404 and "checkpoints" not in leaked.text
    assert "adapter_config.json" not in rest.get_external_weights_urls(path).result().urls

    # Deleting the export invalidates every URL handed out for it.
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert status(urls["adapter_model.safetensors"]) == 404


def test_export_errors_listing_and_deletion(service: tinker.ServiceClient, engine: LocalEngine) -> None:
    client = trained_model(service, seed=8)
    sampler_path = client.save_weights_for_sampler("plain").result().path
    path = client.save_weights_external("exp1").result().path
    rest = service.create_rest_client()

    with pytest.raises(ValueError, match="external weights checkpoints"):
        rest.get_external_weights_urls(sampler_path).result()
    # The engine refuses a non-external checkpoint on its own too (the SDK never sends one).
    sampler_urls = httpx.get(
        f"{engine.base_url}/api/v1/training_runs/{client.model_id}/checkpoints/sampler_weights/plain"
        "/external_weights_urls",
        headers=engine.auth_headers,
    )
    assert sampler_urls.status_code == 404
    assert "not an external_weights checkpoint" in sampler_urls.json()["detail"]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest.get_external_weights_urls(f"tinker://{client.model_id}/external_weights/missing").result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls("tinker://nobody:train:0/external_weights/exp1").result()

    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        client.save_weights_external("exp1").result()
    with pytest.raises(tinker.RequestFailedError) as info:
        client.save_weights_external("sealed", age_encryption_recipients=["age1examplerecipient"]).result()
    assert "age_encryption_recipients[0] 'age1examplerecipient' is no age recipient" in str(info.value)
    # The refused requests kept their turn in the model's queue: the next save runs at once.
    kept = client.save_weights_external("exp2", ttl_seconds=7200).result().path
    assert seq_gaps(engine, client.model_id) == [], "a refused save must not leave a gap in the seq_id order"

    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert set(listed) == {sampler_path, path, kept}
    assert listed[path].checkpoint_type == "external"
    assert listed[path].checkpoint_id == "external_weights/exp1"
    assert (listed[path].size_bytes or 0) > 0

    rest.delete_checkpoint(client.model_id, "external_weights/exp1").result()
    remaining = {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert remaining == {sampler_path, kept}
    assert not (engine.data_dir / "runs" / client.model_id / "external_weights" / "exp1").exists()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint(client.model_id, "external_weights/exp1").result()


def test_exports_survive_a_restart_and_old_urls_do_not(
    service: tinker.ServiceClient, engine: LocalEngine, model_dir: Path, tmp_path: Path
) -> None:
    client = trained_model(service, seed=10)
    path = client.save_weights_external("lasting").result().path
    old_urls = service.create_rest_client().get_external_weights_urls(path).result().urls
    before = {name: httpx.get(url).content for name, url in old_urls.items()}

    # A second engine on a copy of the data dir plays the restarted engine (a data dir has one owner).
    shutil.copytree(engine.data_dir, tmp_path / "data")
    second = start_engine(tmp_path / "data", model_dir, tmp_path / "second.log")
    try:
        rest = second.rest_client()
        listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
        assert listed[path].checkpoint_type == "external"
        new_urls = rest.get_external_weights_urls(path).result().urls
        assert set(new_urls) == set(old_urls)
        assert {name: httpx.get(url).content for name, url in new_urls.items()} == before
        # Its signing secret is new: a URL signed by the first engine is refused.
        moved = old_urls["adapter_model.safetensors"].replace(engine.base_url, second.base_url)
        assert httpx.get(moved).status_code == 403
    finally:
        assert second.stop() == 0, second.log()[-3000:]


def test_signatures_expire() -> None:
    secret = b"k" * 32
    signature = sign_file(secret, "m:train:0", "exp", "adapter_config.json", 1000)
    check_file_signature(secret, "m:train:0", "exp", "adapter_config.json", "1000", signature, now=999.0)
    with pytest.raises(Forbidden, match="expired"):
        check_file_signature(secret, "m:train:0", "exp", "adapter_config.json", "1000", signature, now=1001.0)
    with pytest.raises(Forbidden, match="invalid signature"):
        check_file_signature(b"x" * 32, "m:train:0", "exp", "adapter_config.json", "1000", signature, 999.0)
    with pytest.raises(Forbidden, match="invalid signature"):
        check_file_signature(secret, "m:train:0", "exp", "adapter_config.json", "-1", signature, 999.0)
    for junk_expires, junk_signature in (("²", signature), ("1000", "é" * 64)):
        with pytest.raises(Forbidden, match="invalid signature"):
            check_file_signature(
                secret, "m:train:0", "exp", "adapter_config.json", junk_expires, junk_signature, 999.0
            )
