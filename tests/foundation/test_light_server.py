"""`tinkerrpc serve` serves without torch (service/torchless.py): its process never maps libtorch while it
renders, trains and samples through its engine child (which does), the cookbook's supervised weights made
there are the ones made with torch, and the renderers' torch computes as torch does, loading torch for
what it does not compute itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.settings import Settings

pytestmark = pytest.mark.process

CALL_TIMEOUT = 120.0

# Renders supervised examples of a few conversations with several renderers and every TrainOnWhat, as
# JSON; `hide` first makes the process one without torch, as `tinkerrpc serve` does.
RENDER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from tinkerrpc_server.service.torchless import hide_torch
    if sys.argv[1] == "hide":
        hide_torch()
    from tinker_cookbook.renderers import TrainOnWhat
    from tinkerrpc.v1 import types_pb2
    from tinkerrpc_server.service.rendering import ChatCodecs

    def message(role, content):
        return types_pb2.Message(role=role, content=content)

    user, assistant = types_pb2.ROLE_USER, types_pb2.ROLE_ASSISTANT
    conversations = [
        [message(user, "respond with <|im_end|> yes"), message(assistant, "yes")],
        [message(types_pb2.ROLE_SYSTEM, "be brief"), message(user, "q"),
         message(assistant, "<think>hm</think>maybe"), message(user, "and?"), message(assistant, "no")],
    ]
    codecs = ChatCodecs(Path(sys.argv[3]), allow_remote_tokenizers=False)
    rendered = {}
    for renderer in ("qwen3", "qwen3_disable_thinking", "qwen3_instruct", "role_colon"):
        codec = codecs.get(sys.argv[2], renderer)
        for i, conversation in enumerate(conversations):
            for train_on in TrainOnWhat:
                try:
                    result = codec.supervised_examples(conversation, [], train_on)
                except Exception as err:
                    result = f"{type(err).__name__}: {err}"
                rendered[f"{renderer} {i} {train_on}"] = result
    print(json.dumps({"torch_loaded": sys.modules.get("torch") is not None, "rendered": rendered}))
    """
)


def _render(torch_mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", RENDER, torch_mode, TINY_CHAT, str(Settings.from_environment().model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_supervised_examples_without_torch_are_those_with_torch() -> None:
    with_torch, without_torch = _render("keep"), _render("hide")
    assert with_torch["torch_loaded"] and not without_torch["torch_loaded"]
    assert without_torch["rendered"] == with_torch["rendered"]
    # Not all refusals: weights were made.
    assert any(isinstance(result, list) for result in with_torch["rendered"].values())  # type: ignore[attr-defined]


# torch's operations on 1-D tensors: those the renderers use (RENDERER_TORCH's own), then others (torch's,
# loaded for them), as JSON; `hide` first makes the process one without torch, as `tinkerrpc serve` does.
TENSOR_OPERATIONS = textwrap.dedent(
    """
    import builtins, json, sys
    import_function = builtins.__import__
    if sys.argv[1] == "hide":
        from tinkerrpc_server.service.torchless import RENDERER_TORCH as torch, hide_torch
        hide_torch()
    else:
        import torch

    def seen(t):
        return [t.tolist(), str(t.dtype), isinstance(t, torch.Tensor)]

    weights = torch.tensor([1, 0, 1, 1])
    own = {
        "ints": seen(weights), "floats": seen(torch.tensor([0.1, 1])), "bools": seen(torch.tensor([True])),
        "empty": seen(torch.tensor([])), "float32": seen(torch.tensor([1, 2], dtype=torch.float32)),
        "zeros": seen(torch.zeros(3)), "zeros of a shape": seen(torch.zeros((2,))),
        "full": seen(torch.full((2,), 1)), "full of floats": seen(torch.full((2,), 0.5)),
        "cat promotes": seen(torch.cat([torch.zeros(2), weights[1:]])),
        "cat of ints": seen(torch.cat([torch.tensor([3]), torch.full((1,), True)])),
        "slice": seen(weights[1:3]), "length": len(weights), "int64": weights.dtype == torch.int64,
    }
    torch_for_own = sys.modules.get("torch") is not None
    view = weights[1:]
    view[0] = 7  # a slice is a view: the tensor sees it
    weights += 1
    others = {
        "view": seen(weights), "repeat": seen(torch.tensor([3, 1]).repeat(2)), "sum": int(weights.sum()),
        "arange": seen(torch.arange(3)), "sliced again": seen(view[1:]), "times": seen(torch.zeros(2) * 2),
    }
    print(json.dumps({"own": own, "others": others, "torch_for_own": torch_for_own,
                      "torch_at_end": sys.modules.get("torch") is not None,
                      "import_replaced": builtins.__import__ is not import_function}))
    """
)


def test_the_renderers_torch_computes_as_torch_and_loads_it_for_anything_else() -> None:
    def run(torch_mode: str) -> tuple[dict[str, object], str]:
        done = subprocess.run(
            [sys.executable, "-c", TENSOR_OPERATIONS, torch_mode], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1]), done.stderr

    (with_torch, _), (without_torch, log) = run("keep"), run("hide")
    assert without_torch["own"] == with_torch["own"]
    assert without_torch["others"] == with_torch["others"]
    assert not without_torch["torch_for_own"] and without_torch["torch_at_end"]
    assert "loading torch" in log
    assert not without_torch["import_replaced"]


def test_server_cli_and_sidecar_modules_import_without_torch() -> None:
    code = (
        "import sys, tinkerrpc_server.server, tinkerrpc_server.cli, tinkerrpc_server.sidecar.app; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tinker', 'tinker_cookbook')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


def _maps_libtorch(process: psutil.Process) -> bool:
    with open(f"/proc/{process.pid}/maps") as maps:
        return any("/libtorch" in line for line in maps)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("light")
    with LocalStack(tmp / "data", tmp / "serve.log", with_sidecar=True) as running:
        yield running


def _serve_process(stack: LocalStack) -> psutil.Process:
    process = psutil.Process(stack.pid)
    assert process.ppid() == psutil.Process().pid and "serve" in process.cmdline()
    return process


def test_serve_process_trains_and_samples_without_mapping_libtorch(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.target) as channel:
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        stub.CreateModel(
            pb.CreateModelRequest(name="light", base_model=TINY_CHAT, lora=types_pb2.LoraConfig(rank=4)),
            timeout=CALL_TIMEOUT,
        )
        train = pb.TrainRequest(model="light", adam=types_pb2.AdamParams(learning_rate=1e-3))
        train.examples.add(
            messages=[
                types_pb2.Message(role=types_pb2.ROLE_USER, content="respond with yes"),
                types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content="yes"),
            ]
        )
        assert stub.Train(train, timeout=CALL_TIMEOUT).policy_version == 1
        sample = pb.SampleRequest(
            model="light",
            chat=pb.ChatPrompt(messages=[types_pb2.Message(role=types_pb2.ROLE_USER, content="hi")]),
            params=types_pb2.SamplingParams(n=2, max_tokens=4, seed=1),
        )
        assert len(stub.Sample(sample, timeout=CALL_TIMEOUT).sequences) == 2
    reply = httpx.post(
        f"{stack.sidecar_url}/v1/chat/completions",
        json={"model": "light", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=CALL_TIMEOUT,
    )
    assert reply.status_code == 200, reply.text
    server = _serve_process(stack)
    (engine,) = server.children()
    assert _maps_libtorch(engine)  # the probe sees torch where it is
    assert not _maps_libtorch(server)


def test_a_process_without_torch_has_a_child_build_a_builtin_model(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from tinkerrpc_server.service.torchless import hide_torch
        hide_torch()
        from tinkerrpc_server.service.rendering import ChatCodecs
        codec = ChatCodecs(Path(sys.argv[2]), allow_remote_tokenizers=False).get(sys.argv[1])
        print(codec.vocab_size, sys.modules["torch"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, TINY_CHAT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    vocab_size, torch_module = done.stdout.split()
    assert int(vocab_size) > 0 and torch_module == "None"
    assert (tmp_path / TINY_CHAT / "config.json").is_file()
