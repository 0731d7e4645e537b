"""Hardening of running engines: the tensor-parallel rendezvous listens on loopback only,
cancellation reaches the call it was meant for, quitting a TUI while models load returns
at once, both models' context lengths are respected (chat trims its history), and the
SSD worker's deadline for the prompt's prefill grows with the prompt.
"""

from __future__ import annotations

import ipaddress
import os
import sys

import pytest

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.engine import Engine
from support.drafts import draft_of

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# --------------------------------------------------------------------------- network
def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[len("socket:[") : -1])
    return found


def _address(hex_ip: str) -> ipaddress._BaseAddress:
    """/proc/net/tcp{,6} local address (little-endian 32-bit words) -> ip address."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_addresses(pids: list[int]) -> list[str]:
    """'ip:port' of every listening TCP socket owned by `pids`."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    ip, port = local.split(":")
                    found.append(f"{_address(ip)}:{int(port, 16)}")
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@linux_only
def test_tensor_parallel_rendezvous_listens_on_loopback_only(tiny_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), pin_cpus=False, target_devices=("cpu", "cpu")
    )
    with Engine(config) as engine:
        pids = [os.getpid(), *(p.pid for p in engine.tp_group.procs)]
        listening = listening_addresses(pids)
        assert listening, "the rendezvous store should be listening"
        exposed = [a for a in listening if not _is_loopback(a)]
        assert not exposed, f"listening beyond this machine: {exposed}"
        done = list(engine.generate(["hello"], SamplingParams(max_new_tokens=3)))
        assert done[-1].outputs[0].token_ids


# --------------------------------------------------------------------------- context lengths
@pytest.fixture(scope="module")
def short_draft(tiny_dir, tmp_path_factory):
    """The tiny draft with a 64-position context (the target keeps 512)."""
    from support.tiny_models import copy_with_context

    return copy_with_context(tiny_dir["draft_llama"], tmp_path_factory.mktemp("short") / "draft", 64)


@pytest.mark.parametrize("mode", [Mode.SD, Mode.SSD])
def test_the_draft_models_context_is_respected(tiny_dir, short_draft, mode):
    from ssdlocal.core.errors import UsageError

    k = 3
    spec = SpecConfig(mode=mode, k=k, draft=draft_of(str(short_draft)))
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), spec=spec, pin_cpus=False)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Engine(config) as engine:
        budget = engine.max_prompt_tokens(params.max_new_tokens, spec)
        ssd_extra = k + 2 if mode is Mode.SSD else 0
        assert budget == 64 - ssd_extra - params.max_new_tokens
        done = list(engine.generate([[5] * budget], params, spec=spec))[-1]
        assert len(done.outputs[0].token_ids) == params.max_new_tokens
        with pytest.raises(UsageError) as info:
            list(engine.generate([[5] * (budget + 1)], params, spec=spec))
        assert "the draft model's context is" in info.value.message
        ar = SpecConfig(mode=Mode.AR)  # AR never runs the draft: the target's 512 count
        assert engine.max_prompt_tokens(params.max_new_tokens, ar) == 512 - params.max_new_tokens


def test_chat_history_is_trimmed_to_the_context(tiny_dir):
    from ssdlocal.core.errors import UsageError
    from ssdlocal.tui.core import Conversation

    spec = SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(tiny_dir["draft_llama"])))
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), spec=spec, pin_cpus=False)
    params = SamplingParams(max_new_tokens=64)
    conversation = Conversation("You are terse.")
    for _ in range(12):  # far more history than 512 positions hold
        conversation.add_turn(
            "Tell me about the quick brown fox and the lazy dog.", "The quick brown fox jumps over the lazy dog. " * 3
        )
    with Engine(config) as engine:
        budget = engine.max_prompt_tokens(params.max_new_tokens, spec)
        assert len(conversation.prompt_ids(engine.tokenizer, "and then?")) > budget
        ids, dropped = conversation.fit_prompt_ids(engine.tokenizer, "and then?", budget)
        assert 0 < dropped < 12 and len(ids) <= budget
        assert len(conversation.messages) == 2 * (12 - dropped)
        assert conversation.prompt_ids(engine.tokenizer, "and then?") == ids
        done = list(engine.generate([ids], params, spec=spec))[-1]  # fits: no error
        assert done.outputs[0].token_ids
        with pytest.raises(UsageError) as info:  # the message alone is too long
            conversation.fit_prompt_ids(engine.tokenizer, "fox " * 600, budget)
        assert "/max" in info.value.hint


# --------------------------------------------------------------------------- cancellation
def test_a_token_cancelled_before_generate_starts_stops_it(tiny_dir):
    from ssdlocal.core.cancel import CancelToken

    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), pin_cpus=False)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    with Engine(config) as engine:
        token = CancelToken()
        token.cancel()  # e.g. Esc pressed before the worker thread reached generate
        done = list(engine.generate(["hello", "world"], params, cancel=token))
        assert len(done) == 1
        assert [o.finish_reason for o in done[0].outputs] == ["cancelled", "cancelled"]
        engine.cancel()  # reaches no call: the next one runs in full
        full = list(engine.generate(["hello"], params))[-1]
        assert len(full.outputs[0].token_ids) == 50
        parent = CancelToken()
        child = CancelToken(parent)
        events = engine.generate(["hello"], params, cancel=child)
        next(events)  # the first token: the call is running
        parent.cancel()  # an app quitting stops every call made under it
        last = list(events)[-1]
        assert last.outputs[0].finish_reason == "cancelled"
        assert len(last.outputs[0].token_ids) < 50


# --------------------------------------------------------------------------- SSD deadlines
@linux_only
@pytest.mark.draft_loss
def test_the_ssd_prefill_deadline_grows_with_the_prompt(tiny_dir, monkeypatch):
    """A worker that is slow to prefill (here: stopped for 3 s as START is sent) is
    waited for when the prompt is long, but a short prompt's deadline still catches it."""
    import signal
    import threading

    from ssdlocal.draft.ssd import client as ssd_client
    from ssdlocal.draft.ssd.protocol import Cmd

    monkeypatch.setattr(ssd_client, "RECV_TIMEOUT_S", 1.0)
    draft = str(tiny_dir["draft_llama"])
    spec = SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(draft), fan_out=(1, 1, 1, 1), backup="jit")
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), spec=spec, pin_cpus=False)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    send = ssd_client.DraftWorkerClient.send
    timers = []

    def stall_then_send(self, cmd, payload=None):
        if cmd == Cmd.START:  # stopped before START is sent, so READY cannot slip out first
            os.kill(self.proc.pid, signal.SIGSTOP)
            timer = threading.Timer(3.0, os.kill, (self.proc.pid, signal.SIGCONT))
            timers.append(timer)
            timer.start()
        send(self, cmd, payload)

    with Engine(config) as engine:
        monkeypatch.setattr(ssd_client.DraftWorkerClient, "send", stall_then_send)
        try:
            done = list(engine.generate([[5] * 300], params))[-1]  # deadline 1 + 75 s
            assert len(done.outputs[0].token_ids) == 8 and done.stats.draft_losses == 0
            short = list(engine.generate([[5]], params))[-1]  # deadline 1 + 2 * 0.25 s < 3 s
            assert "did not answer within 1.5 s" in short.stats.draft_lost  # caught: the call went on without it
            assert len(short.outputs[0].token_ids) == 8
        finally:
            for timer in timers:
                timer.join()
