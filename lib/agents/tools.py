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
  do (lib/rewards/worker.py); a call that raises, hangs, kills the child or returns something that cannot be
  printed becomes an error message the model reads, and is counted; it never stops the run.
- Environments (`environment_factory`, docs/agents.md 7): a class whose public methods are an episode's tools. Its
  instances live in the same child, one per episode, addressed by the episode's id: `ToolWorker.open` makes one and
  calls its `reset(**row)`, `call(..., episode=)` runs one of its methods, `close_episode` reads its `get_reward()`
  and drops it.
"""


from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
import sys
import types
from dataclasses import dataclass


from lib.rewards.worker import RewardCallFailed, RewardWorker, serve
from lib.rewards.scoring import _load_module, object_spec  # the reward specs' importer: the same forms and messages

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_RESULT_CHARS = 2000  # a longer tool result is cut (the model's context is the limit that matters)


# ---------------------------------------------------------------------------------------------------------------
# Tools: specs, schemas, the prompt


def tool_spec(tool, what: str = "tool") -> str:
    """A tool (or, `what` "environment", an environment class) given as an object, as the spec the worker imports it
    by ('module:function' or 'file.py:function'): the tool runs in a child process, which imports it rather than
    receiving it. A lambda or a function defined inside another has no such name, and is refused with the fix."""
    return object_spec(tool, what)


def load_tool(spec: str, what: str = "tool"):
    """The function a tool spec names ('module:function', 'file.py:function'); ValueError naming the spec."""
    module_part, _, attr = spec.rpartition(":")
    kind = "function" if what == "tool" else "Class"
    if not module_part or not attr:
        raise ValueError(f"{what} {spec!r}: give it as 'module:{kind}' or 'file.py:{kind}'")
    target = _load_module(spec, module_part, what)
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{what} {spec!r}: module {module_part!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"{what} {spec!r}: {attr!r} is a {type(target).__name__}, not a {kind.lower()}")
    return target


# TRL's rule (GRPOTrainer, environment_factory): the class's functions not starting with "_", but reset and get_reward
ENVIRONMENT_HOOKS = ("reset", "get_reward")


def load_environment(spec: str) -> type:
    """The environment class a spec names; ValueError naming the spec and the fix where it is not a class or has no
    `reset`."""
    cls = load_tool(spec, "environment")
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r} is a {type(cls).__name__}, not a class: give the environment's class "
                         "(the tool worker makes one instance of it per episode)")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"environment {spec!r}: class {cls.__name__} has no reset method; an environment defines "
                         "reset(**row), called with the data-set row at the start of each episode")
    return cls


def environment_methods(cls: type) -> list[str]:
    """The names of an environment class's tools, in name order: its functions (as TRL lists them:
    inspect.getmembers of the class, so properties are not read) not starting with "_", but reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


def environment_tools(cls: type) -> list:
    """An environment class's tools as functions without `self` (each method bound to a placeholder: their schemas
    are read, never called, in the trainer's process)."""
    tools = []
    for name in environment_methods(cls):
        func = getattr(cls, name)
        static = isinstance(inspect.getattr_static(cls, name), staticmethod)
        tools.append(func if static else types.MethodType(func, object()))
    return tools


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


def _tools_setup(init):
    """The child's side: the tools `specs` and the environment classes `environments` ({name: spec}) loaded; the
    jobs it answers are ("call", episode, name, arguments) (episode None: a tool of the run's own), ("open",
    episode, environment name, row) and ("close", episode)."""
    specs, environments = init
    tools = {}
    for spec in specs:
        func = load_tool(spec)
        tools[getattr(func, "__name__", spec)] = func
    classes = {name: load_environment(spec) for name, spec in environments.items()}
    instances: dict = {}  # episode id -> its environment instance, from "open" to "close"

    def run(label: str, func, arguments: dict) -> tuple[bool, object]:
        try:
            out = func(**arguments)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            return True, out
        except Exception as error:  # noqa: BLE001 - the model (or the trainer) reads it; the run goes on
            return False, f"error: {label} raised {type(error).__name__}: {error}"

    def call(episode, name: str, arguments: dict) -> tuple[bool, str]:
        table = dict(tools)
        if episode is not None:
            if episode not in instances:
                return False, (f"error: {name}: this episode's environment is gone (the tool worker was restarted "
                               "after an earlier call hung or killed it)")
            instance = instances[episode]
            table.update({method: getattr(instance, method) for method in environment_methods(type(instance))})
        if name not in table:
            return False, f"error: no tool named {name!r}; the tools are {', '.join(table)}"
        ok, out = run(name, table[name], arguments)
        if not ok:
            return ok, out
        try:
            return True, printable(out)
        except Exception as error:  # noqa: BLE001 - str() of the result raised
            return False, f"error: {name} raised {type(error).__name__}: {error}"

    def open_episode(episode, name, row: dict) -> tuple[bool, object]:
        cls = classes[name]
        try:
            instance = cls()
        except Exception as error:  # noqa: BLE001 - the trainer names it
            return False, f"{cls.__name__}() raised {type(error).__name__}: {error}"
        ok, out = run(f"{cls.__name__}.reset", instance.reset, row)
        if not ok:
            return ok, out[len("error: "):]
        if out is not None and not isinstance(out, str):
            return False, (f"{cls.__name__}.reset returned a {type(out).__name__}; it returns None or the text "
                           "appended to the prompt")
        instances[episode] = instance
        return True, out

    def close_episode(episode) -> tuple[bool, object]:
        instance = instances.pop(episode, None)
        if instance is None:
            return False, "its environment is gone (the tool worker was restarted after a call hung or killed it)"
        if not callable(getattr(instance, "get_reward", None)):
            return True, None
        ok, out = run(f"{type(instance).__name__}.get_reward", instance.get_reward, {})
        if ok and out is not None:
            try:
                out = float(out)
            except (TypeError, ValueError):
                return False, f"{type(instance).__name__}.get_reward returned {out!r:.80}, not a number"
        return ok, out

    actions = {"call": call, "open": open_episode, "close": close_episode}

    def answer(jobs: list[tuple]) -> list:
        # the reward worker's frame: (delivered, payload) per job; a tool's own failure is a delivered outcome
        return [(True, actions[kind](*args)) for kind, *args in jobs]
    return answer


async def _awaited(awaitable):
    return await awaitable


class EnvironmentFailed(RuntimeError):
    """An environment that could not start an episode: its class or its `reset` raised, hung or killed the worker."""


class ToolWorker(RewardWorker):
    """The tools `specs` and the environments `environments` ({name: class spec}) in a child process;
    `call(name, arguments, episode=None)` -> (result text, failed), each call with a time limit of `timeout` seconds
    (0: none). The child starts on the first call, and again after a call that hung or killed it; the environments of
    the episodes open then are lost with it (their later calls fail with a message)."""

    CHILD, NAME, TIMEOUT_KEY = "lib.agents.tools", "tool worker", "tool_timeout"

    def __init__(self, specs: list[str], timeout: float, environments: dict | None = None):
        super().__init__(specs, {}, timeout)
        self.environments = dict(environments or {})
        self.children = 0  # children started; an episode lives in the child it was opened in
        self.opened: dict = {}  # episode id -> the child it lives in

    def init_payload(self):
        return self.specs, self.environments

    def _start(self) -> None:
        super()._start()
        self.children += 1

    def _lives(self, episode) -> bool:
        return (self.opened.get(episode) == self.children and self.conn is not None and self.proc is not None
                and self.proc.poll() is None)

    def call(self, name: str, arguments: dict, episode=None) -> tuple[str, bool]:
        """One call, in a request of its own (its own time limit): (the text the model reads, whether it failed).
        `episode`: the episode whose environment's methods are tools too."""
        if episode is not None and episode not in self.opened:
            return f"error: {name}: episode {episode} has no environment open (never opened, or ended)", True
        if episode is not None and not self._lives(episode):
            return (f"error: {name}: this episode's environment is gone (the tool worker was restarted after an "
                    "earlier call hung or killed it)"), True
        [out] = self.run([("call", episode, name, arguments)])
        if isinstance(out, RewardCallFailed):  # it hung or killed the worker
            return f"error: {name} {out}", True
        ok, text = out
        return text, not ok

    def open(self, episode, environment, row: dict) -> str | None:
        """Make episode `episode`'s instance of environment `environment` and call its reset(**row): the text it
        returns (None: nothing to add to the prompt). Raises EnvironmentFailed naming the class and the cause."""
        cls = self.environments[environment].rpartition(":")[2]
        [out] = self.run([("open", episode, environment, row)])
        if isinstance(out, RewardCallFailed):
            raise EnvironmentFailed(f"environment_factory: {cls}'s reset {out}")
        ok, payload = out
        if not ok:
            raise EnvironmentFailed(f"environment_factory: {payload} (the data-set row's columns: "
                                    f"{', '.join(map(str, row))})")
        self.opened[episode] = self.children
        return payload

    def close_episode(self, episode) -> tuple[float | None, str | None]:
        """Episode `episode`'s environment dropped, after its get_reward() where it has one: (the reward or None,
        an error message or None)."""
        if not self._lives(episode):
            self.opened.pop(episode, None)
            return None, "its environment is gone (the tool worker was restarted after a call hung or killed it)"
        del self.opened[episode]
        [out] = self.run([("close", episode)])
        if isinstance(out, RewardCallFailed):
            return None, f"get_reward {out}"
        ok, payload = out
        return (payload, None) if ok else (None, str(payload))


def start_tools(tools: list, timeout: float, environments: dict | None = None, *,
                start: bool = True) -> tuple[list[str], list[dict], ToolWorker]:
    """(specs, schemas, worker): the one builder of a run's tools, which the trainer (lib/agents/episodes.Agent
    .from_config), the evaluator and the chat page call with their `tools` and `tool_timeout`. Each tool (a function,
    'module:function' or 'file.py:function') is imported and described (`tool_schemas`), then the worker that runs
    their calls (and the `environments`' methods: {name: class spec}) is made and, unless `start` is false, started:
    it imports them in its child while the models load. Raises ValueError naming the tool and the fix before any
    worker exists."""
    specs = [tool_spec(t) for t in tools]
    schemas = tool_schemas(specs)
    worker = ToolWorker(specs, timeout, environments)
    if start:
        worker.start()
    return specs, schemas, worker


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), _tools_setup)
