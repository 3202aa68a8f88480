"""Data sets read with the `datasets` library: hub ids, folders that `save_to_disk` wrote, and folders laid out as
the hub lays a data set out (data/train-00000-of-00002.parquet shards, a README's configurations).

lib/data/records.py reads local .jsonl / .json / .parquet files and folders of {split}.jsonl / .json / .parquet itself, with
row-exact errors, and hands every other name to a reader; this module is that reader (`read_rows`, `split_names`):
lib/setup.load_data passes it to lib.data.records.load_records / split_names (`reader=hub_data`). Rows come back as (location,
row) pairs, validated by lib/data/records.py as any file's are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from lib.data.records import is_saved_dataset

# Hub ids that need a config name; load_dataset refuses them without one.
HUB_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}

# Seconds the hub may take to say whether a data set exists before it counts as unreachable: `datasets` itself
# retries a failed connection for about 25 s (measured here, with no route to the hub) before it gives up.
HUB_TIMEOUT_S = 10

# What to change when `datasets` refuses a configuration or a split.
SPLIT_FIX = ("--dataset_config NAME picks a configuration, --dataset_train_split / --dataset_test_split NAME a "
             "split")


def one_line(err: BaseException) -> str:
    """An exception on one line: its type and the first 300 characters of its message, whitespace folded."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"



@contextmanager
def _hub_offline(on: bool):
    """The hub's offline mode (HF_HUB_OFFLINE) for one call when `on`: `datasets` then reads its cache only, at once,
    instead of retrying the network. The libraries read the variable when they are imported, so the flag is set on
    their modules for the call, and put back."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _from_hub(name: str, call: Callable):
    """Returns call(), a `datasets` call on the hub id `name`, after asking the hub about `name` with a limit of
    HUB_TIMEOUT_S: an unknown id fails at once, and when the hub cannot be reached the call reads the datasets cache
    only (offline mode) instead of retrying for about 25 s. Raises ValueError saying which happened."""
    import datasets
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    unreachable = None
    if datasets.config.HF_HUB_OFFLINE:
        unreachable = "offline mode is on (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"
    else:
        try:
            HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
        except RepositoryNotFoundError:  # GatedRepoError too: a gated data set this login has no access to
            raise ValueError(f"dataset_name={name!r}: the hub has no such data set, or it is private or gated and "
                             f"this machine is not logged in with access (`hf auth login`); check the id, or pass a "
                             f"local file or folder") from None
        # no route, a refused connection, a timeout, a proxy or a server error: the hub cannot be asked now
        except Exception as err:  # noqa: BLE001
            unreachable = f"the hub was not reachable within {HUB_TIMEOUT_S} s ({one_line(err)})"
    try:
        with _hub_offline(unreachable is not None):
            return call()
    except (ConnectionError, FileNotFoundError) as err:  # datasets' "couldn't reach" and "not cached"
        if unreachable is None:
            raise ValueError(f"dataset_name={name!r}: {one_line(err)}") from err
        raise ValueError(f"dataset_name={name!r}: {unreachable}, and the datasets cache holds no copy of it. Pass a "
                         f"local file or folder as dataset_name (laid out as the hub lays it out, or written by "
                         f"save_to_disk), or load it once where the hub is reachable") from err
    # datasets' own refusals: an unknown split or configuration, a file it cannot read
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"dataset_name={name!r}: {one_line(err)}. {SPLIT_FIX}") from err


def _dataset_rows(dataset, label: str) -> list[tuple[str, dict]]:
    """(location, row) pairs of a `datasets.Dataset`."""
    return [(f"{label}, row {i}", row) for i, row in enumerate(dataset.to_list(), start=1)]



def _load_saved(path: Path, name: str):
    """The Dataset or DatasetDict in a save_to_disk folder; ValueError when it cannot be read."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001  (missing Arrow files, damaged JSON: load_from_disk's many errors)
        raise ValueError(f"dataset_name={name!r}: a folder save_to_disk wrote, but load_from_disk cannot read it "
                         f"({one_line(err)})") from err


def _read_saved(path: Path, name: str, split: str) -> list[tuple[str, dict]]:
    """(location, row) pairs of split `split` of a saved DatasetDict, or of a saved Dataset (one split, so `split`
    does not apply)."""
    import datasets

    loaded = _load_saved(path, name)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise FileNotFoundError(f"dataset_name={name!r}: the saved DatasetDict has no split {split!r}; its splits: "
                                    f"{list(loaded)}")
        return _dataset_rows(loaded[split], f"{name} (split {split})")
    return _dataset_rows(loaded, name)


def _folder_config(path: Path, name: str, config: str | None) -> tuple[str | None, str | None]:
    """(configuration name, data_dir) for `datasets` to read configuration `config` of a local folder: one its
    README declares (the hub's layout: openai/gsm8k's README declares `main` as main/train-*.parquet and
    main/test-*.parquet), else a subfolder of that name read as a data set of its own."""
    if config is None:
        return None, None
    import datasets

    try:
        declared = datasets.get_dataset_config_names(str(path))
    except Exception:  # noqa: BLE001  (a folder datasets reads nothing in declares nothing)
        declared = []
    if config in declared:
        return config, None
    if (path / config).is_dir():
        return None, config
    raise ValueError(f"dataset_config={config!r}: {name!r} declares no such configuration (it declares "
                     f"{declared}) and has no subfolder {config!r}")


def _folder_splits(path: Path, name: str, config: str | None) -> list[str]:
    """The splits `datasets` finds in a local folder (split-named files, data/train-00000-of-00002.parquet shards,
    the configurations of a README), for configuration `config`; [] when it finds nothing to read."""
    import datasets

    config_name, data_dir = _folder_config(path, name, config)
    try:
        return list(datasets.get_dataset_split_names(str(path), config_name, data_dir=data_dir))
    except Exception:  # noqa: BLE001  (an empty folder, no data files: the caller says what the folder holds)
        return []


def _read_folder(path: Path, name: str, split: str, config: str | None) -> list[tuple[str, dict]]:
    """(location, row) pairs of split `split` of a local folder, read as datasets.load_dataset reads it (the same
    data-files resolution as for a hub id)."""
    import datasets

    if split not in _folder_splits(path, name, config):
        raise FileNotFoundError(
            f"dataset_name={name!r} is a folder without {split}.jsonl, {split}.json or {split}.parquet, and "
            f"datasets finds no {split!r} split in it (its splits: {_folder_splits(path, name, config)}; it holds "
            f"{sorted(p.name for p in path.iterdir())})")
    config_name, data_dir = _folder_config(path, name, config)
    try:
        dataset = datasets.load_dataset(str(path), config_name, data_dir=data_dir, split=split)
    except Exception as err:  # noqa: BLE001  (a file datasets cannot read, columns that differ between shards)
        raise ValueError(f"dataset_name={name!r} (split {split!r}): datasets cannot read it ({one_line(err)})") from err
    return _dataset_rows(dataset, f"{name} (split {split})")


def _read_hub(name: str, split: str, config: str | None) -> list[tuple[str, dict]]:
    """Returns (location, row) pairs of a hub data set; raises ValueError when it cannot be loaded."""
    import datasets  # slow to import; only hub ids and folders that are not <split>.jsonl need it

    config = config or HUB_CONFIGS.get(name)
    dataset = _from_hub(name, lambda: datasets.load_dataset(name, config, split=split))
    return _dataset_rows(dataset, f"{name} (split {split})")



def read_rows(name: str, split: str, config: str | None) -> list[tuple[str, dict]]:
    """(location, row) pairs of split `split` of a folder save_to_disk wrote, of a local folder `datasets` reads
    (the hub's layout), or of a hub id; raises ValueError / FileNotFoundError naming the data set and the fix."""
    path = Path(name).expanduser()
    if path.is_dir():
        if is_saved_dataset(path):
            return _read_saved(path, name, split)
        return _read_folder(path, name, split, config)
    return _read_hub(name, split, config)


def split_names(name: str, config: str | None = None) -> list[str] | None:
    """The splits `datasets` finds, sorted: a saved DatasetDict's (None for a saved Dataset, which has no splits), a
    local folder's (configuration `config`), a hub data set's."""
    import datasets

    path = Path(name).expanduser()
    if path.is_dir():
        if is_saved_dataset(path):
            loaded = _load_saved(path, name)
            return sorted(loaded) if isinstance(loaded, datasets.DatasetDict) else None
        return sorted(_folder_splits(path, name, config))
    config = config or HUB_CONFIGS.get(name)
    return sorted(_from_hub(name, lambda: datasets.get_dataset_split_names(name, config)))

