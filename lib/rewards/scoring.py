"""Which reward functions a run uses, and calling them: `--reward_funcs` specs resolved (our built-in names,
'module:function', 'file.py:function'; a reward model's folder or hub id through the `models` hook), the keyword
arguments TRL passes them (prompts, completions, completion_ids, trainer_state and every other column), and scoring a
batch (sync and `async def` functions, a time limit per call, failures counted, None skipped). The functions
themselves are lib/rewards/functions.py.
"""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


from lib.rewards.functions import REWARD_FUNCS, RewardFunc


# ---------------------------------------------------------------------------------------------------------------------
# Resolving `--reward_funcs`

_HOW_TO_CUSTOM = (
    "Built-in reward functions: {names}. For your own, pass 'module:function' or 'module.function' (a module on "
    "sys.path) or 'path/to/file.py:function', called as TRL calls it: function(prompts=..., completions=..., **columns) returns "
    "one float (or None to skip) per completion; columns holds per-completion lists such as answer. A reward model "
    "is a folder or hub id of a sequence-classification model (num_labels=1)."
)

# A dotted Python name ("package.module.function", TRL's form).
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def spec_error(spec: str, problem: str, named_rewards: dict = REWARD_FUNCS) -> ValueError:
    return ValueError(f"reward function {spec!r}: {problem}. " + _HOW_TO_CUSTOM.format(names=", ".join(named_rewards)))


def _load_module(spec: str, module_part: str, what: str | None = None, named_rewards: dict = REWARD_FUNCS):
    """Import `module_part`, a dotted module name or a path to a .py file (relative to the working directory). A spec
    that is not a reward function's (`what`: tool, environment) gets its errors in its own words."""
    def error(problem: str) -> ValueError:
        return spec_error(spec, problem, named_rewards) if what is None else ValueError(f"{what} {spec!r}: {problem}")

    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise error(f"file {module_part!r} not found (a path is read from the working directory, {Path.cwd()})")
        # importlib recipe "Importing a source file directly"; the prefix keeps 'math.py' from shadowing math.
        module_spec = importlib.util.spec_from_file_location(f"_agrpo_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_part)
    except ImportError as exc:
        raise error(f"cannot import module {module_part!r} ({exc})") from exc


def object_spec(obj, what: str = "tool") -> str:
    """A function or class given as an object, as the spec a worker process imports it by ('module:name', or
    'file.py:name' for one defined in the script that runs): a worker imports it rather than receiving it, and
    config.yaml records the spec. A lambda or a definition nested in another has no such name: ValueError with the
    fix. `what` names the key's kind in the message (tool, environment, rollout_func)."""
    if isinstance(obj, str):
        return obj
    kind = "class" if what == "environment" else "function"
    name, module = getattr(obj, "__qualname__", ""), getattr(obj, "__module__", None)
    if not name or "<" in name or module is None:
        raise ValueError(f"{what} {obj!r}: a {what} must be a {kind} defined at the top level of a module or file "
                         f"(it is imported by name); a lambda or a nested {kind} cannot be")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError(f"{what} {name!r} is defined in an interactive session: put it in a .py file")
        return f"{Path(path).resolve()}:{name}"
    return f"{module}:{name}"


def _keyword_only(func) -> set[str]:
    """Names of `func`'s keyword-only parameters; none for a callable whose signature Python cannot read."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _bind_options(spec: str, func: RewardFunc, options: dict, built_in: bool) -> RewardFunc:
    """`func` with the entries of `options` that name one of its keyword-only parameters bound (functools.partial).

    Only keyword-only parameters: a function that takes **columns would otherwise receive every option as if it were
    a data-set column. A built-in is called once on an empty batch, so that a bad value (a buffer longer than the
    limit) fails here, at start-up, instead of on every step inside score_completions, which would score it as an
    error and go on.
    """
    bound = {key: value for key, value in options.items() if key in _keyword_only(func)}
    if not bound:
        return func
    func = functools.partial(func, **bound)
    if built_in:
        try:
            func([], [], answer=[], completion_length=[])
        except ValueError as exc:
            raise ValueError(f"reward function {spec!r}: {exc}") from exc
    return func


def resolve_reward_funcs(specs: list[str], options: dict | None = None, models=None,
                         named_rewards: dict[str, RewardFunc] = REWARD_FUNCS) -> list[tuple[str, RewardFunc]]:
    """(name, function) per spec, in order. A spec is a built-in name, 'module:function', 'module.function' (TRL's
    form) or 'file.py:function', or, where `models` is given, a reward model: models(spec) is (name, the model to
    load) for a folder or hub id of one, None otherwise (lib/models/reward_models.reward_model_spec, which the entry
    scripts pass). A custom function is named by its `__name__`, a built-in by our name: a key of `named_rewards`
    (lib/rewards/functions.REWARD_FUNCS, or lib/rewards/open_r1.REWARD_FUNCS, which
    lib/models/reward_models.reward_functions passes). Raises ValueError naming the spec and the fix on any bad spec
    (TRL's reward names: lib/trl_keys.reward_name).

    `options` (e.g. {"max_len": 1000, "ngram_size": 3}): each function gets, bound, the entries whose key is one of its
    keyword-only parameters, and nothing else; the name stays the spec's. A built-in with a bad value raises here."""
    options = options or {}
    resolved = []
    for spec in specs:
        if spec in named_rewards:
            resolved.append((spec, _bind_options(spec, named_rewards[spec], options, built_in=True)))
            continue
        model = models(spec) if models else None
        if model is not None:
            resolved.append(model)
            continue
        if spec.endswith(".py"):
            raise spec_error(spec, f"name the function in the file: '{spec}:function'", named_rewards)
        if ":" in spec:
            module_part, _, attr = spec.rpartition(":")
        elif _DOTTED.fullmatch(spec):
            module_part, _, attr = spec.rpartition(".")
        else:
            raise spec_error(spec, "unknown name", named_rewards)
        if not module_part or not attr:
            raise spec_error(spec, "unknown name", named_rewards)
        func = getattr(_load_module(spec, module_part, named_rewards=named_rewards), attr, None)
        if func is None:
            raise spec_error(spec, f"module {module_part!r} has no attribute {attr!r}", named_rewards)
        if not callable(func):
            raise spec_error(spec, f"{attr!r} is a {type(func).__name__}, not a function", named_rewards)
        resolved.append((getattr(func, "__name__", attr), _bind_options(spec, func, options, built_in=False)))
    names = [name for name, _ in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        # Rewards are logged and weighted by name, so two functions with one name would overwrite each other.
        raise ValueError(f"reward function names must be unique, got {duplicates} more than once in {specs}")
    return resolved


# ---------------------------------------------------------------------------------------------------------------------
# What a reward function is given


@dataclass(frozen=True)
class RewardState:
    """The run's progress, passed as `trainer_state` (TRL passes transformers' TrainerState, which has these three
    among others): optimizer steps done, the run's length in steps, and epochs of the training data drawn so far
    (a float). Plain and picklable, so that it crosses into the reward worker."""

    global_step: int
    max_steps: int
    epoch: float


def is_conversational(record: dict) -> bool:
    """A record whose prompt is a conversation: a list of {role, content} messages under `prompt`, TRL's
    conversational format (lib/data/records.py checks the messages when it loads them)."""
    return isinstance(record.get("prompt"), list)


# Keys of a record never passed as columns: the names TRL passes itself (and leaves out of its columns).
_NOT_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions", "trainer_state")


def reward_arguments(records: list[dict], prompt_texts: list[str | None],
                     texts: list[str]) -> tuple[list, list, dict[str, list]]:
    """TRL's arguments for one batch, from each completion's record, its prompt as rendered for the policy
    (lib/data/records.render_prompt; None for a conversational record) and its decoded text: (prompts, completions,
    columns). The records' forms are lib/data/records.py's:

    - a conversation under `prompt`: prompts are its messages as the data holds them, completions
      [{"role": "assistant", "content": text}] (TRL's conversational form);
    - a text `prompt` (TRL's standard form) or a math-format record (`problem`): prompts are the rendered prompt
      text, completions the text.

    columns: every other key of the records, one value per completion; not the prompt (`prompt`, or `problem` for a
    record without `prompt`, whose prompt it is), as TRL leaves out its `prompt` column.
    """
    prompts, completions = [], []
    for record, prompt_text, text in zip(records, prompt_texts, texts, strict=True):
        if is_conversational(record):
            prompts.append(record["prompt"])
            completions.append([{"role": "assistant", "content": text}])
        else:
            prompts.append(prompt_text)
            completions.append(text)
    keys = dict.fromkeys(key for r in records for key in r)  # every record's keys, in the order first seen
    prompt_key = "problem" if records and "prompt" not in records[0] else None
    columns = {key: [r.get(key) for r in records] for key in keys if key not in _NOT_COLUMNS and key != prompt_key}
    return prompts, completions, columns


# ---------------------------------------------------------------------------------------------------------------------
# Running the functions

def is_async(func) -> bool:
    """Whether calling `func` gives a coroutine: an `async def` function, a functools.partial of one (options
    bound), or an object whose __call__ is `async def` (inspect.iscoroutinefunction looks at the object itself)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(type(func), "__call__", None))


def describe_failure(exc: BaseException) -> str:
    """What a failed call did, as a predicate of the function's name ("raised KeyError: 'x'", "gave no answer ...")."""
    return str(exc) if getattr(exc, "predicate", False) else f"raised {type(exc).__name__}: {exc}"


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for async reward functions, run by a daemon thread (TRL runs them the same way):
    one loop serves every call, so a client a function keeps (an HTTP session) stays bound to a live loop, and the
    caller may itself be inside a running loop (a notebook), where asyncio.run would refuse."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agrpo-async-rewards", daemon=True).start()
            _loop = loop
    return _loop


def run_jobs(funcs: list[RewardFunc], jobs: list[tuple[int, dict]]) -> list:
    """Reward calls in this process. A job is (function index, keyword arguments). Synchronous functions run one after
    another, `async def` ones all at once on the event loop (the reward worker gives them a time limit:
    lib/rewards/worker.with_time_limit). Returns per job its output, or the exception it raised: this never
    raises for a function."""
    results: list = [None] * len(jobs)
    waiting = []
    for j, (k, kwargs) in enumerate(jobs):
        if is_async(funcs[k]):
            waiting.append(j)
            continue
        try:
            results[j] = funcs[k](**kwargs)
        # User code can raise anything; catching Exception (not BaseException: Ctrl-C still stops) is the point here.
        except Exception as exc:  # noqa: BLE001
            results[j] = exc
    if waiting:
        async def one(k: int, kwargs: dict):
            try:
                return await funcs[k](**kwargs)
            except Exception as exc:  # noqa: BLE001
                return exc

        async def together():
            return await asyncio.gather(*(one(*jobs[j]) for j in waiting))

        for j, out in zip(waiting, asyncio.run_coroutine_threadsafe(together(), _event_loop()).result()):
            results[j] = out
    return results


def _as_floats(name: str, values, expected: int) -> list[float]:
    """Check one function's output: a list of `expected` numbers or None (-> NaN). A wrong shape or type is a bug in
    the function, not a flaky completion, so it raises ValueError instead of being scored."""
    if not isinstance(values, (list, tuple)) or len(values) != expected:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ValueError(f"reward function {name!r} returned {got} for {expected} completions; "
                         "it must return a list with one float (or None) per completion")
    floats = []
    for value in values:
        if value is None:
            floats.append(math.nan)
        elif isinstance(value, numbers.Real):
            floats.append(float(value))
        else:
            raise ValueError(f"reward function {name!r} returned {value!r} ({type(value).__name__}); "
                             "each reward must be a float or None")
    return floats


def score_completions(
    reward_funcs: list[tuple[str, RewardFunc]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    error_value: float | None = 0.0,
    call: Callable | None = None,
    nonfinite: dict[str, int] | None = None,
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: RewardState | None = None,
    records: list[dict] | None = None,
) -> tuple[list[list[float]], dict[str, int]]:
    """Run every reward function on the batch, as TRL calls them: keyword arguments prompts, completions,
    completion_ids (if given), trainer_state (if given) and the columns. Synchronous functions run one after
    another, then the `async def` ones together (TRL's order).

    Returns (rewards, errors): rewards[k][i] is function k's reward for completion i (NaN where the function returned
    None); errors[name] counts the completions on which that function raised and got `error_value` (None -> NaN).
    A function that raises on the batch is retried one completion at a time (an async one on all of them at once),
    so one bad completion costs one reward, not the whole batch. Raises ValueError for a wrong-length or non-numeric
    result or a column of the wrong length.

    call(jobs, concurrent): how the functions run, jobs being (function index, keyword arguments), returning each
    job's output or exception (default: run_jobs, in this process; the trainer passes
    lib.rewards.worker.RewardWorker.run, which runs them in a worker with a time limit and returns a timeout or a dead
    worker as an exception, scored like any). A function with `in_process` set (a reward model, an environment's reward)
    always runs in this process. One with a `prompts_of(records)` method (a reward model: lib/models/reward_models.py)
    is given what it returns, from each completion's record, as its prompts. nonfinite: if given,
    nonfinite[name] counts the completions the function scored inf, -inf or NaN (None is not counted: it means the
    function does not apply).
    """
    funcs = [func for _, func in reward_funcs]
    own_prompts = {k: func.prompts_of(records) for k, func in enumerate(funcs) if hasattr(func, "prompts_of")}
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt once per completion")
    per_completion = {**columns, "prompts": list(prompts), "completions": list(completions)}
    if completion_ids is not None:
        per_completion["completion_ids"] = completion_ids
    for key, column in per_completion.items():
        if len(column) != n:
            raise ValueError(f"column {key!r} has {len(column)} values for {n} completions")
    shared = {} if trainer_state is None else {"trainer_state": trainer_state}

    def arguments(k: int, i: int | None = None) -> dict:
        batch = per_completion if own_prompts.get(k) is None else {**per_completion, "prompts": own_prompts[k]}
        if i is not None:
            batch = {key: [column[i]] for key, column in batch.items()}
        return {**batch, **shared}

    def run(jobs: list[tuple[int, dict]]) -> list:
        k = jobs[0][0]
        if call is None or getattr(funcs[k], "in_process", False):  # one the worker does not hold (a reward model)
            return run_jobs(funcs, jobs)
        return call(jobs, is_async(funcs[k]))

    fallback = None if error_value is None else float(error_value)  # None: skipped, like a function's None
    outputs = {k: run([(k, arguments(k))])[0] for k, func in enumerate(funcs) if not is_async(func)}
    concurrent = [k for k, func in enumerate(funcs) if is_async(func)]
    if concurrent:
        outputs.update(zip(concurrent, run([(k, arguments(k)) for k in concurrent])))
    rewards, errors = [], {}
    for k, (name, func) in enumerate(reward_funcs):
        errors[name] = 0
        values = outputs[k]
        if isinstance(values, Exception):
            batch_exc = values
            jobs = [(k, arguments(k, i)) for i in range(n)]
            # one completion at a time; an async function's single-completion calls all at once
            ones = run(jobs) if is_async(func) and jobs else [run([job])[0] for job in jobs]
            warned = set()
            values = []
            for one in ones:
                if isinstance(one, Exception):
                    errors[name] += 1
                    values.append(fallback)
                    message = f"reward function {name!r} {describe_failure(one)}; scored {fallback}"
                    if message not in warned:  # one line per distinct failure, no traceback per completion
                        warnings.warn(message, RuntimeWarning, stacklevel=2)
                        warned.add(message)
                    continue
                checked = _as_floats(name, one, 1)[0]
                values.append(None if one[0] is None else checked)
            if not errors[name]:
                warnings.warn(f"reward function {name!r} {describe_failure(batch_exc)} on the batch but on no single "
                              "completion", RuntimeWarning, stacklevel=2)
        floats = _as_floats(name, values, n)
        if nonfinite is not None:
            nonfinite[name] = sum(v is not None and not math.isfinite(f) for v, f in zip(values, floats))
        rewards.append(floats)
    return rewards, errors
