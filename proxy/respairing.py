"""Tool-pairing diagnosis and repair of a Responses API request's ``input`` items (pure).

The Responses API (``POST /v1/responses``) carries a conversation as a list of items: messages,
reasoning, the model's tool calls and the client's outputs, paired by ``call_id``. OpenAI refuses
a list with a call and no output (``No tool output found for function call call_…``: an agent
interrupted while its tools ran) and one with an output that answers no call (``No tool call found
for function call output with call_id call_…``: a client that trimmed its history, or merged two).
``repair_input`` fixes both, deterministically; ``diagnose`` and ``format_strict_error`` explain
them instead in strict mode.

Only what the request itself holds is judged. With ``previous_response_id``, ``conversation`` or an
``item_reference`` item, the calls an output answers may be stored at the provider, so no output is
taken for an orphan; a call in the list still needs its output in the list.

Calls paired: ``function_call``, ``custom_tool_call``, ``shell_call``, ``apply_patch_call`` and a
``tool_search_call`` the client runs (answered by an output of their own type) and ``local_shell_call`` (answered by a
``function_call_output``, as Codex CLI writes it, or a ``local_shell_call_output``, whose ``id``
the SDKs' types name the call by: its ``call_id`` or its ``id`` answers it, and one that answers
no call is left alone). Other items are left alone: the hosted tools' calls carry their
results, and a computer call's output is a screenshot a proxy cannot make up (one that answers
no call is an orphan, its screenshot kept). An output answers
no call when no item of the list but an output has its ``call_id`` (a client may answer a call
of another type with a ``function_call_output``, as Codex CLI does a local shell call).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.pairing import PairingResult, Repair, orphan_label
from proxy.prefix import deep_dumps

OUTPUT_OF: Final[Mapping[str, str]] = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
    "local_shell_call": "function_call_output",
    "shell_call": "shell_call_output",
    "apply_patch_call": "apply_patch_call_output",
    "tool_search_call": "tool_search_output",
}
"""Each call item's type, and the type of the output item a synthetic one is given (a tool
search's when the client ran it: a hosted one's is the provider's, see ``_kind``)."""

OUTPUTS: Final = frozenset(
    {
        "function_call_output",
        "custom_tool_call_output",
        "shell_call_output",
        "apply_patch_call_output",
        "tool_search_output",
        "computer_call_output",
    }
)
"""The output items whose ``call_id`` must be a call's (else they are orphans). A computer
call's output is one (its screenshot is kept when it answers none), though the call is not
paired: its output is a screenshot a proxy cannot make up."""

_TEXT_OUTPUTS: Final = frozenset({"function_call_output", "custom_tool_call_output"})
"""Those whose ``output`` list is of a message's parts (``input_text``, ``input_image`` …)."""

LOCAL_SHELL_OUTPUT: Final = "local_shell_call_output"

_SERVER_STATE_KEYS: Final = ("previous_response_id", "conversation")

_SEARCH: Final = frozenset({"tool_search_call", "tool_search_output"})


def _kind(item: Mapping[str, Any]) -> Any:
    """``item``'s type as the pairing reads it: a tool search the provider ran (``execution``
    ``server``, a hosted tool's call and its results) is neither a call paired here nor an
    output that must answer one (``hosted_tool_search_…``). A ``type`` that is no string (a
    list: no item of the API's) is None, as an item without one."""
    kind = item.get("type")
    if type(kind) is not str:
        return None
    if kind in _SEARCH and item.get("execution") == "server":
        return f"hosted_{kind}"
    return kind


def _call_id(item: Mapping[str, Any]) -> str | None:
    """An item's ``call_id``: an empty one too (a gateway's for a model that gave none), which
    OpenAI pairs as any (``No tool output found for function call .``)."""
    value = item.get("call_id")
    return value if isinstance(value, str) else None


def _reference(item: Any) -> bool:
    """An item that names a stored one by id: ``{"type": "item_reference", "id": …}``, or only
    ``{"id": …}`` (its ``type`` is optional)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and item.keys() == {"id"})


def stored_elsewhere(body: Mapping[str, Any]) -> bool:
    """Whether ``body`` continues a conversation stored at the provider (a previous response,
    a conversation, an item referenced by id), whose calls its outputs may answer."""
    if any(body.get(key) for key in _SERVER_STATE_KEYS):
        return True
    items = body.get("input")
    return isinstance(items, list) and any(_reference(item) for item in items)


@dataclass(slots=True)
class PairingScan:
    """What the pairing check read of ``items``: the position of the first call of each
    ``call_id`` (of the calls paired here), the ids outputs answer (a local shell call's output
    answers by its ``call_id`` or ``id``: either may be the call's ``call_id``, or its ``id``,
    which stands for its ``call_id`` here: ``shell_answers`` and ``shell_ids`` until the end),
    the ``call_id`` of every item but an output (a call of any type: what an output may
    answer), those the outputs paired here give, and whether an item names a stored one. A
    left fold over the items: a next turn that resends them, the very objects, and appends
    more is read from where this one ended (``check``). A value, never mutated."""

    items: tuple[Any, ...] = ()
    calls: dict[str, int] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    known: set[str] = field(default_factory=set)
    outputs: set[str] = field(default_factory=set)  # the ``call_id`` of each of ``OUTPUTS``
    shell_ids: dict[str, str] = field(default_factory=dict)  # a local shell call's id -> call_id
    shell_answers: tuple[str, ...] = ()
    references: bool = False

    def precedes(self, items: Sequence[Any]) -> bool:
        """``items`` starts with the very same objects (an agent's next turn, shared)."""
        n = len(self.items)
        return n <= len(items) and all(map(operator.is_, self.items, items))

    def extended(self, items: Sequence[Any]) -> PairingScan:
        """The scan of ``items``, which this one ``precedes``: of those after its own only."""
        start = len(self.items)
        calls, answered, known = dict(self.calls), set(self.answered), set(self.known)
        outputs, shell_ids = set(self.outputs), dict(self.shell_ids)
        shell_answers = list(self.shell_answers)
        references = self.references
        for i, item in enumerate(itertools.islice(items, start, None), start):
            if not isinstance(item, dict):
                continue
            kind = _kind(item)
            if kind not in OUTPUTS and not (isinstance(kind, str) and kind.endswith("_output")):
                call_id = _call_id(item)
                if call_id is not None:
                    known.add(call_id)
            if kind in OUTPUT_OF:
                call_id = _call_id(item)
                if call_id is not None:
                    calls.setdefault(call_id, i)
                    if kind == "local_shell_call" and isinstance(item.get("id"), str):
                        shell_ids.setdefault(item["id"], call_id)
            elif kind in OUTPUTS:
                call_id = _call_id(item)
                if call_id is not None:
                    answered.add(call_id)
                    outputs.add(call_id)
            elif kind == LOCAL_SHELL_OUTPUT:
                shell_answers += (
                    v for v in (item.get("call_id"), item.get("id")) if isinstance(v, str)
                )
            elif isinstance(kind, str) and kind.endswith("_output"):
                # an output of a type not paired here (a hosted tool search's) answers the
                # call of its ``call_id`` all the same: no synthetic output is added beside it
                call_id = _call_id(item)
                if call_id is not None:
                    answered.add(call_id)
            elif not references and _reference(item):
                references = True
        return PairingScan(
            tuple(items),
            calls,
            answered,
            known,
            outputs,
            shell_ids,
            tuple(shell_answers),
            references,
        )

    def answers(self) -> set[str]:
        """The ids the outputs answer, a local shell call's output's ``id`` read as its call's."""
        if not self.shell_answers:
            return self.answered
        ids = self.shell_ids
        return self.answered | {ids.get(answer, answer) for answer in self.shell_answers}

    def defective(self, body: Mapping[str, Any]) -> bool:
        """Whether the items scanned (``body``'s ``input``) have a call without an output, or
        an output that answers no call (none when the calls may be stored at the provider)."""
        if not self.calls.keys() <= self.answers():
            return True
        stored = self.references or any(body.get(key) for key in _SERVER_STATE_KEYS)
        return not stored and not self.outputs <= self.known


_NO_SCAN: Final = PairingScan()


def _scan(items: Sequence[Any]) -> tuple[dict[str, int], set[str], set[str]]:
    """The position of the first call of each ``call_id`` (of the calls paired here), the ids
    outputs answer and the ``call_id`` of every item but an output (``PairingScan``)."""
    scan = _NO_SCAN.extended(items)
    return scan.calls, scan.answers(), scan.known


def _defects(items: Sequence[Any], stored: bool) -> tuple[list[int], list[int]]:
    """The positions of the calls without an output, and of the outputs that answer no call
    (none when the calls may be stored at the provider)."""
    calls, answered, known = _scan(items)
    dangling = sorted(i for call_id, i in calls.items() if call_id not in answered)
    orphans: list[int] = []
    if not stored:
        for i, item in enumerate(items):
            if isinstance(item, dict) and _kind(item) in OUTPUTS:
                call_id = _call_id(item)
                if call_id is not None and call_id not in known:
                    orphans.append(i)
    return dangling, orphans


def needs_repair(body: Mapping[str, Any]) -> bool:
    """Whether ``body``'s ``input`` list has a call without an output, or an output that answers
    no call."""
    return check(body)[0]


def check(
    body: Mapping[str, Any], kept: Sequence[PairingScan] = ()
) -> tuple[bool, PairingScan | None, PairingScan | None]:
    """``needs_repair``, resumed from the first of ``kept`` that ``precedes`` ``body``'s items
    (the work in proportion to what was appended); with the scan of its items for the next
    turn to resume from (None: no list of items), and the one resumed from."""
    items = body.get("input")
    if not isinstance(items, list):
        return False, None, None
    resumed = next((scan for scan in kept if scan.precedes(items)), None)
    scan = (resumed or _NO_SCAN).extended(items)
    return scan.defective(body), scan, resumed


_NAMES: Final = {
    "local_shell_call": "shell",
    "shell_call": "shell",
    "apply_patch_call": "apply_patch",
    "tool_search_call": "tool_search",
}


def _name(item: Mapping[str, Any]) -> str:
    name = item.get("name")
    if isinstance(name, str) and name:
        return name
    return _NAMES.get(item.get("type", ""), "(unnamed)")


def _synthetic(call: Mapping[str, Any], call_id: str | None, note: str) -> dict[str, Any]:
    """The output item given a call without one: ``note`` as its text. A shell call's is its
    commands' captured output (the note as their stderr, an exit code of 130, a process cut by
    Ctrl+C's); a patch's, a failure (``status`` is ``completed`` or ``failed``: the note says it
    may have been applied); a tool search's, one that loaded no tools (its item has no text, so
    no note: what Codex CLI gives an interrupted one)."""
    kind = OUTPUT_OF[call["type"]]
    if kind == "tool_search_output":
        return {
            "type": kind,
            "call_id": call_id,
            "execution": "client",
            "status": "completed",
            "tools": [],
        }
    if kind == "shell_call_output":
        outcome = {"type": "exit", "exit_code": 130}
        output = [{"stdout": "", "stderr": note, "outcome": outcome}]
        return {"type": kind, "call_id": call_id, "output": output}
    if kind == "apply_patch_call_output":
        return {"type": kind, "call_id": call_id, "status": "failed", "output": note}
    return {"type": kind, "call_id": call_id, "output": note}


def _in_run(item: Any) -> bool:
    """A call or an output item: what a turn's run of calls and their outputs is made of."""
    if not isinstance(item, dict):
        return False
    kind = _kind(item)
    return kind in OUTPUT_OF or kind in OUTPUTS or kind == LOCAL_SHELL_OUTPUT


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and _kind(item) in OUTPUT_OF


def _run_ends(items: Sequence[Any], starts: Sequence[int], orphans: set[int]) -> list[int]:
    """For each of ``starts`` (ascending), the position after the run of call and output items
    it begins: a turn's parallel calls and the outputs already sent for them, where a synthetic
    output goes (an orphan output ends the run: it becomes a user message, which would part a
    call from its output). A call right after an output begins another run: the next turn's
    (a model that does not reason puts nothing between), whose items would otherwise push the
    synthetic output further back every turn, the prefix the provider cached with it. One pass
    from the last start back (thousands of calls: linear)."""
    if not starts:
        return []
    ends: dict[int, int] = {}
    end = len(items)
    i = len(items) - 1
    for start in reversed(starts):
        while i > start:  # (``end``: past the run that holds item ``i - 1``, if it is in one)
            item = items[i]
            if (
                not _in_run(item)
                or i in orphans
                or (_is_call(item) and _in_run(items[i - 1]) and not _is_call(items[i - 1]))
            ):
                end = i
            i -= 1
        ends[start] = end
    return [ends[start] for start in starts]


def _as_message_part(part: Any) -> Any:
    """An output's content part as a message takes it: an image's ``detail``, which an output
    may leave out, is required there (``auto`` where none was given)."""
    if isinstance(part, dict) and part.get("type") == "input_image" and part.get("detail") is None:
        return {**part, "detail": "auto"}
    return part


def _screenshot(output: Any) -> dict[str, Any] | None:
    """A computer call output's screenshot as a message's image part (None: not one)."""
    if not isinstance(output, dict) or output.get("type") != "computer_screenshot":
        return None
    image = {
        key: output[key] for key in ("image_url", "file_id") if isinstance(output.get(key), str)
    }
    return {"type": "input_image", **image, "detail": "auto"} if image else None


def _downgraded(item: Mapping[str, Any], label: str) -> dict[str, Any]:
    """A user message carrying an orphan output's content under ``label``: nothing is lost (a
    tool search's loaded tools as JSON text, a computer call's screenshot as an image)."""
    kind = item.get("type")
    output = item.get("tools") if kind == "tool_search_output" else item.get("output")
    content: list[Any]
    screenshot = _screenshot(output) if kind == "computer_call_output" else None
    if screenshot is not None:
        content = [{"type": "input_text", "text": label}, screenshot]
    elif output is None or output == "":
        content = [{"type": "input_text", "text": label}]
    elif isinstance(output, str):
        content = [{"type": "input_text", "text": f"{label}\n{output}"}]
    elif isinstance(output, list) and kind in _TEXT_OUTPUTS:  # (a message's parts)
        content = [{"type": "input_text", "text": label}, *map(_as_message_part, output)]
    else:
        dumped = deep_dumps(output, sort_keys=True, ensure_ascii=False)
        content = [{"type": "input_text", "text": f"{label}\n{dumped}"}]
    return {"type": "message", "role": "user", "content": content}


def repair_input(
    body: Mapping[str, Any],
    *,
    orphan_policy: str = "downgrade",
    interrupted_note: str,
    placed: Mapping[str, int] | None = None,
    record: dict[str, int] | None = None,
) -> PairingResult:
    """``body``'s ``input`` items with each call given an output and each orphan output kept
    as a user message (``orphan_policy = "downgrade"``) or removed (``"drop"``).

    A call without an output gets a synthetic one (``interrupted_note``, its ``{name}`` the
    tool's) after the run of call and output items it belongs to, in call order, or where
    ``placed`` says an earlier request of the session had it (its ``call_id`` -> the position
    in the client's list it went before), if that is within the run: the model's next call,
    made after that output, comes right after the interrupted call in the client's list,
    which never had the output, and would otherwise push it back, out of the prefix the
    provider cached. ``record``, if given, gets where each went. The result's ``messages`` is
    the input list itself when nothing was wrong. ``index`` in each repair is the item's
    position in the client's list."""
    items = body.get("input")
    if not isinstance(items, list):
        return PairingResult([], [])
    dangling, orphans = _defects(items, stored_elsewhere(body))
    if not dangling and not orphans:
        return PairingResult(items, [])
    repairs: list[Repair] = []
    after: dict[int, list[dict[str, Any]]] = {}  # position -> synthetic outputs to insert there
    orphan_set = set(orphans)
    for i, end in zip(dangling, _run_ends(items, dangling, orphan_set), strict=True):
        call = items[i]
        call_id, name = _call_id(call), _name(call)
        earlier = placed.get(call_id) if placed and call_id is not None else None
        if earlier is not None and i < earlier <= end:
            end = earlier
        if record is not None and call_id is not None:
            record[call_id] = end
        synthetic = _synthetic(call, call_id, interrupted_note.replace("{name}", name))
        after.setdefault(end, []).append(synthetic)
        repairs.append(Repair("dangling_call", i, call_id, f"added a synthetic output for {name}"))
    out: list[Any] = []
    for i, item in enumerate(items):
        out.extend(after.get(i, ()))
        if i in orphan_set:
            call_id = _call_id(item)
            if orphan_policy == "drop":
                repairs.append(Repair("orphan_result", i, call_id, "dropped"))
                continue
            out.append(_downgraded(item, orphan_label(call_id)))
            repairs.append(Repair("orphan_result", i, call_id, "kept as a user message"))
            continue
        out.append(item)
    out.extend(after.get(len(items), ()))
    repairs.sort(key=lambda r: r.index)
    return PairingResult(out, repairs)


def stored_call_outputs(
    body: Mapping[str, Any], calls: Sequence[Mapping[str, Any]], note: str
) -> list[tuple[dict[str, Any], str, str]]:
    """Outputs for the calls of the stored response ``body`` continues (``calls``: that
    answer's ``function_call`` and ``custom_tool_call`` items, as cachegate relayed it) that its
    ``input`` answers nothing for, each with its call's id and name, to go first in the input:
    an agent interrupted after such an answer sends its next message alone, which OpenAI
    refuses (``No tool output found for function call …``) on every turn after. ``note``: as
    ``repair_input``'s."""
    items = body.get("input")
    if not isinstance(items, (list, str)):  # (no input, or one the provider is to refuse)
        return []
    answered = {
        _call_id(item)
        for item in (items if isinstance(items, list) else ())
        if isinstance(item, Mapping) and str(_kind(item)).endswith("_output")
    }
    out: list[tuple[dict[str, Any], str, str]] = []
    for call in calls:
        call_id = _call_id(call)
        if call_id is None or call_id in answered:
            continue
        name = _name(call)
        out.append((_synthetic(call, call_id, note.replace("{name}", name)), call_id, name))
        answered.add(call_id)
    return out


def diagnose(body: Mapping[str, Any]) -> list[Repair]:
    """What ``repair_input`` would repair, changing nothing: strict mode's list of defects."""
    return repair_input(body, interrupted_note="").repairs


def format_strict_error(
    body: Mapping[str, Any], repairs: list[Repair], stored: Sequence[str] = ()
) -> str:
    """One error message naming every defect with its item's index, type and ``call_id``;
    first, the calls of the stored response the request continues that it gives no output for
    (``stored``: their ``call_id``, ``stored_call_outputs``)."""
    items = body.get("input")
    previous = body.get("previous_response_id")
    parts = [
        f"call {call_id} of the stored response {previous} has no output in input (dangling_call)"
        for call_id in stored
    ]
    for r in repairs:
        item = items[r.index] if isinstance(items, list) else {}
        kind = item.get("type") if isinstance(item, dict) else None
        call_id = r.tool_call_id if r.tool_call_id != "" else '""'  # (an empty one, shown)
        if r.kind == "dangling_call":
            text = f"input[{r.index}] {kind} {call_id} has no output"
        else:
            text = f"input[{r.index}] {kind} for {call_id} answers no call"
        parts.append(f"{text} ({r.kind})")
    count = len(repairs) + len(stored)
    head = f"cachegate strict pairing: {count} defect{'' if count == 1 else 's'}"
    return f"{head}: {'; '.join(parts)}" if parts else head
