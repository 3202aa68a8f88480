"""Tools for agents (docs/agents.md): their specs and schemas, the plain call format, the built-in calculator, and
the worker process they run in. Light on purpose (no torch): the worker's child imports this module.

- `tool_schemas`: the JSON schema of each tool, from its type hints and Google-style docstring (transformers'
  `get_json_schema`, as TRL builds them); they reach the prompt through the chat template (`tools=`), or through
  `plain_tool_prompt` where the template has no tool format (the embedded SmolLM2 has none).
- `parse_tool_calls` / `turn_tool_calls`: the calls of one model turn, in the template's own format where the
  tokenizer has a response parser (transformers' `parse_response`), or in the plain format otherwise: a call is
  `<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>`, the format of Hermes and
  Qwen2.5's templates, so a model that learnt one reads the other.
- `ToolWorker`: the tools run in a child process, each call with a time limit (`tool_timeout`), as reward functions
  do (lib/extras/reward_worker.py); a call that raises, hangs, kills the child or returns something that cannot be
  printed becomes an error message the model reads, and is counted; it never stops the run.
"""


from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path


from lib.extras.reward_worker import RewardCallFailed, RewardWorker, serve
from lib.reward_funcs import _load_module  # the reward specs' importer: the same forms, the same messages

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_RESULT_CHARS = 2000  # a longer tool result is cut (the model's context is the limit that matters)


# ---------------------------------------------------------------------------------------------------------------
# Tools: specs, schemas, the prompt


def tool_spec(tool) -> str:
    """A tool given as an object, as the spec the worker imports it by ('module:function' or 'file.py:function'):
    the tool runs in a child process, which imports it rather than receiving it. A lambda or a function defined
    inside another has no such name, and is refused with the fix."""
    if isinstance(tool, str):
        return tool
    name, module = getattr(tool, "__qualname__", ""), getattr(tool, "__module__", None)
    if not name or "<" in name or module is None:
        raise ValueError(f"tool {tool!r}: a tool must be a function defined at the top level of a module or file "
                         "(the tool worker imports it by name); a lambda or a nested function cannot be")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError(f"tool {name!r} is defined in an interactive session: put it in a .py file")
        return f"{Path(path).resolve()}:{name}"
    return f"{module}:{name}"


def load_tool(spec: str):
    """The function a tool spec names ('module:function', 'file.py:function'); ValueError naming the spec."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"tool {spec!r}: give it as 'module:function' or 'file.py:function'")
    target = _load_module(spec, module_part)
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"tool {spec!r}: module {module_part!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"tool {spec!r}: {attr!r} is a {type(target).__name__}, not a function")
    return target


def tool_schemas(tools: list) -> list[dict]:
    """Each tool's JSON schema ({"type": "function", "function": {name, description, parameters}}), from its type
    hints and docstring; ValueError naming the tool and what its docstring lacks."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        func = load_tool(tool) if isinstance(tool, str) else tool
        try:
            schemas.append(get_json_schema(func))
        except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tool {getattr(func, '__name__', func)!r}: {error} (a tool needs a type hint on every "
                             "argument and a Google-style docstring with an Args: section)") from None
    names = [s["function"]["name"] for s in schemas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tool names must be unique, got {twice} more than once")
    return schemas


def template_has_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools=` itself (Qwen, Llama 3.1+, Hermes) rather than ignoring them."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def plain_tool_prompt(schemas: list[dict]) -> str:
    """The system-prompt text that describes the tools and the plain call format, for a template without one."""
    lines = "\n".join(json.dumps(s["function"], separators=(", ", ": ")) for s in schemas)
    return ("You can call tools. To call one, write <tool_call>{\"name\": <tool name>, \"arguments\": {<argument>: "
            "<value>}}</tool_call> and stop; its result comes back in a message from the tool, and you go on. "
            f"The tools:\n{lines}")


# ---------------------------------------------------------------------------------------------------------------
# The built-in tool (the demo's: docs/agents.md)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "(12 + 30) * 7 / 2".
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                      bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent above 64")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(ast.parse(expression.replace("^", "**"), mode="eval").body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


# ---------------------------------------------------------------------------------------------------------------
# A model turn's calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The plain format's calls in `text`, in order, and an error message for each call that is not
    {"name": <string>, "arguments": <object>} JSON (the model reads it as the call's result)."""
    calls, errors = [], []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            errors.append(f"error: the tool call is not JSON ({error.msg} at character {error.pos})")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates carry the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            errors.append('error: a tool call is {"name": <tool name>, "arguments": {<argument>: <value>}}')
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls, errors


def turn_tool_calls(tokenizer, ids: list[int], text: str) -> tuple[list[ToolCall], list[str]]:
    """A model turn's calls: through the tokenizer's response parser where it has one (the template's own format),
    else the plain format."""
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        return parse_tool_calls(text)
    try:
        message = tokenizer.parse_response(ids)
    except Exception as error:  # a malformed call: the model reads why
        return [], [f"error: the tool call could not be parsed ({error})"]
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        calls.append(ToolCall(str(function.get("name")), arguments if isinstance(arguments, dict) else {}))
    return calls, []


# ---------------------------------------------------------------------------------------------------------------
# The results, as the chat template renders them


class ResultRenderer:
    """The token ids that follow a model turn ending in the end-of-turn token: the template's close of that turn,
    one `tool` message per result, and the next assistant turn opened. Found once by rendering a conversation with
    and without the tool messages (the template's own text, whatever its format)."""

    SENTINEL = "\u2063agrpo-turn\u2063"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self.SENTINEL}]
        text = tokenizer.apply_chat_template(base, tokenize=False)
        after = text[text.index(self.SENTINEL) + len(self.SENTINEL):]  # the turn's close, e.g. "<|im_end|>\n"
        eos = tokenizer.eos_token or ""
        self.glue = after[len(eos):] if eos and after.startswith(eos) else after
        self.base = text

    def ids(self, results: list[str]) -> list[int]:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self.SENTINEL},
                    *({"role": "tool", "content": r} for r in results)]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not text.startswith(self.base):
            raise ValueError("the chat template renders the conversation before a tool message differently from "
                             "the same conversation without it; tool results cannot be appended to a completion")
        return self.tokenizer.encode(self.glue + text[len(self.base):], add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------
# The tools' process


def printable(value) -> str:
    """A tool's result as the text the model reads: str() of it, cut at MAX_RESULT_CHARS."""
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " [cut]"


def _tools_setup(specs: list[str]):
    tools = {}
    for spec in specs:
        func = load_tool(spec)
        tools[getattr(func, "__name__", spec)] = func

    def outcome(name: str, arguments: dict) -> tuple[bool, str]:
        if name not in tools:
            return False, f"error: no tool named {name!r}; the tools are {', '.join(tools)}"
        try:
            out = tools[name](**arguments)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            return True, printable(out)
        except Exception as error:  # noqa: BLE001 - the model reads it; the run goes on
            return False, f"error: {name} raised {type(error).__name__}: {error}"

    def answer(jobs: list[tuple[str, dict]]) -> list:
        # the reward worker's frame: (delivered, payload) per job; a tool's own failure is a delivered outcome
        return [(True, outcome(name, arguments)) for name, arguments in jobs]
    return answer


async def _awaited(awaitable):
    return await awaitable


class ToolWorker(RewardWorker):
    """The tools `specs` in a child process; `call(name, arguments)` -> (result text, failed), each call with a
    time limit of `timeout` seconds (0: none). The child starts on the first call, and again after a call that
    hung or killed it."""

    CHILD, NAME, TIMEOUT_KEY = "lib.extras.tools", "tool worker", "tool_timeout"

    def __init__(self, specs: list[str], timeout: float):
        super().__init__(specs, {}, timeout)

    def init_payload(self):
        return self.specs

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """One call, in a request of its own (its own time limit): (the text the model reads, whether it failed)."""
        [out] = self.run([(name, arguments)])
        if isinstance(out, RewardCallFailed):  # it hung or killed the worker
            return f"error: {name} {out}", True
        ok, text = out
        return text, not ok


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), _tools_setup)
