"""The ``fedshard`` command: LightningCLI with the federated strategies registered.

``fedshard fit --config configs/shakespeare/fl_hsdp.yaml`` works like any LightningCLI program; because this module
imports :mod:`lightning_fedshard` before parsing, both ``trainer.strategy: fl_hsdp`` and the
``class_path: lightning_fedshard.FLHSDPStrategy`` / ``init_args:`` form are accepted, and
``fedshard fit --trainer.strategy.help lightning_fedshard.FLHSDPStrategy`` lists every strategy argument.
``fedshard plan`` predicts throughput, traffic and memory of each strategy before a run (see
:mod:`lightning_fedshard.plan`).

A bad argument ends the command with a short report on stderr and exit status 2, as argparse does: its first line
is the error itself (for a rejected strategy argument, the strategy's own message), then the argument it concerns.
This holds for values the parser rejects and for values a class rejects when it is built (a ``ValueError`` or
Lightning's ``MisconfigurationException`` from a constructor). An unknown option is one line that names the nearest
valid one. ``JSONARGPARSE_DEBUG=true`` raises the error with its traceback instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from jsonargparse import ArgumentParser, Namespace

# Private: jsonargparse's test of a pending `--print_config` (stable since 4.0): only that dump hides the secrets.
from jsonargparse._actions import _ActionPrintConfig
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_fedshard  # noqa: F401  (registers "fl_fsdp" and "fl_hsdp")
from lightning_fedshard._arguments import did_you_mean

#: Lines of one error's own text that the report keeps.
MAX_ERROR_LINES = 4
#: Further errors (e.g. of other members of a ``Union`` type) that the report names, one line each.
MAX_OTHER_ERRORS = 2

_KEY = re.compile(r'Parser key "(?P<key>[^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '(?P<path>[^']+)':")
_GIVEN_CLASS = re.compile(r"^Given value: Namespace\(class_path='(?P<path>[^']+)'", re.MULTILINE)
_UNION = "Does not validate against any of the Union subtypes"
_ITEM = re.compile(r"(?P<indent>\s*)- ")
_NESTED_HELP = re.compile(r"--(?P<key>[\w.]+)\.(?P<name>\w+)\.help")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.*)", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class Reason:
    """One error inside a jsonargparse message, with the argument it concerns.

    Attributes:
        text: The error's own text, e.g. the message of the constructor that refused a value.
        keys: The parser keys leading to it, outermost first (``("trainer.strategy", "sync_every")``).
        class_path: The class whose arguments hold the value, if any.
    """

    text: str
    keys: tuple[str, ...] = ()
    class_path: str | None = None

    @property
    def shallow(self) -> bool:
        """Whether it only says that the value is not of one member of a ``Union`` (e.g. not a ``str``)."""
        return not self.keys and self.class_path is None and self.text.startswith("Expected a ")

    def help_option(self) -> str:
        """The option that lists the accepted arguments: the class's own ``--key.help`` where there is one."""
        if self.keys and self.class_path is not None:
            return f"--{self.keys[0]}.help {self.class_path}"
        return "--help"

    def argument(self) -> str | None:
        """The argument as written on the command line, e.g. ``--trainer.strategy (lightning_fedshard.X)``."""
        if not self.keys:
            return self.class_path
        name = "--" + ".".join(self.keys)
        return name if self.class_path is None else f"{name} ({self.class_path})"


def _dedent_item(lines: list[str], indent: int) -> str:
    """One ``- item`` of a jsonargparse list with its marker and indentation removed."""
    return "\n".join(line[indent + 2 :] for line in lines)


def _union_items(body: str) -> list[str]:
    """The per-member errors listed under ``Errors:`` in a jsonargparse ``Union`` message."""
    lines = body.splitlines()
    if "Errors:" not in lines:
        return []
    items: list[list[str]] = []
    indent = -1
    for line in lines[lines.index("Errors:") + 1 :]:
        if not line.startswith(" "):  # "Given value type: ..." is back at the message's own indentation
            break
        match = _ITEM.match(line)
        if match and (indent < 0 or len(match["indent"]) == indent):
            indent = len(match["indent"])
            items.append([line])
        elif items:
            items[-1].append(line)
    return [_dedent_item(item, indent) for item in items]


def _union_reasons(body: str) -> list[Reason]:
    """The errors of a ``Union`` message, without those of members the value was never meant for."""
    reasons = [reason for item in _union_items(body) for reason in reasons_of(item)]
    relevant = [reason for reason in reasons if not reason.shallow] or reasons
    given = _GIVEN_CLASS.search(body)
    if given is None:
        return relevant
    return [reason if reason.class_path else replace(reason, class_path=given["path"]) for reason in relevant]


def reasons_of(message: str) -> list[Reason]:
    """The errors inside a jsonargparse error message, most relevant first.

    jsonargparse nests its messages: ``Parser key "k":`` and ``Problem with given class_path 'c':`` headers over
    indented details, and for a ``Union`` type (``trainer.strategy`` is a name or a ``Strategy``) one error per
    member type, followed by a dump of the given value. This keeps each error's own text with the argument it
    concerns and drops the dumps and the members that the value was never meant for.

    Args:
        message: The message, as given to :meth:`ArgumentParser.error` or raised by ``instantiate``.

    Returns:
        The errors; empty if the message has none of jsonargparse's structure and no text.
    """
    head, _, rest = message.strip().partition("\n")
    body = _dedent(rest)
    if match := _KEY.fullmatch(head.strip()):
        return [replace(reason, keys=(match["key"], *reason.keys)) for reason in reasons_of(body)]
    if match := _CLASS.fullmatch(head.strip()):
        return [
            reason if reason.class_path else replace(reason, class_path=match["path"]) for reason in reasons_of(body)
        ]
    if head.strip() == _UNION:
        return _union_reasons(body)
    return [Reason(message.strip())] if message.strip() else []


def _dedent(text: str) -> str:
    """``text`` with the indentation its first line has removed from every line."""
    lines = text.splitlines()
    if not lines:
        return ""
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] if len(line) - len(line.lstrip()) >= indent else line.lstrip() for line in lines)


def short_report(message: str, prog: str) -> list[str]:
    """The lines ``fedshard`` prints for an error: the error first, then its argument, then where to look.

    Args:
        message: A jsonargparse error message.
        prog: The command, e.g. ``fedshard fit``.
    """
    reasons = reasons_of(message) or [Reason("invalid arguments")]
    first, *others = reasons
    text = first.text.splitlines()[:MAX_ERROR_LINES]
    lines = [f"{prog}: error: {text[0]}", *(f"  {line}" for line in text[1:])]
    if (argument := first.argument()) is not None:
        lines.append(f"  argument: {argument}")
    for other in others[:MAX_OTHER_ERRORS]:
        where = other.argument()
        lines.append(f"  also: {other.text.splitlines()[0]}" + ("" if where is None else f" ({where})"))
    lines.append(
        f"tip: `{prog} {first.help_option()}` lists the accepted options; JSONARGPARSE_DEBUG=true shows the traceback"
    )
    return lines


def _debug() -> bool:
    """Whether jsonargparse's debug mode asks for exceptions instead of an exit."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"


def unknown_option_line(message: str, prog: str, options: Iterable[str]) -> str | None:
    """One line for options the parser does not know, each with the nearest valid one; ``None`` for other errors.

    Args:
        message: A jsonargparse error message, e.g. ``"unrecognized arguments: --sync_evry 4"``.
        prog: The command, e.g. ``fedshard plan``.
        options: The parser's options, e.g. ``--sync_every``.
    """
    match = _UNRECOGNIZED.fullmatch(message.strip())
    given = [arg.partition("=")[0] for arg in match["args"].split() if arg.startswith("--")] if match else []
    if not given:  # another error, or stray values (e.g. a list given with spaces): the short report says it
        return None
    names = [option.removeprefix("--") for option in options if option.startswith("--")]
    unknown = "; ".join(f"`{arg}`{did_you_mean(arg.removeprefix('--'), names, '--', n=1)}" for arg in given)
    plural = "s" if len(given) > 1 else ""
    return f"{prog}: error: unknown option{plural} {unknown}; `{prog} --help` lists every option."


def _options(parser: ArgumentParser) -> list[str]:
    """The option strings a parser accepts (``--trainer.max_steps``, ...)."""
    return [option for action in parser._actions for option in action.option_strings]  # argparse's list, stable


class ShortErrorParser(ArgumentParser):
    """A jsonargparse parser that reports an error in a few lines (:func:`short_report`) instead of usage and dumps.

    An unknown option is one line naming the nearest valid one (:func:`unknown_option_line`).
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print the short report and exit with status 2; raise as jsonargparse does if it must not exit.

        Args:
            message: The error.
            ex: The exception behind it, if any.
        """
        if not self.exit_on_error or _debug():
            super().error(message, ex)
        self.logger.error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        line = unknown_option_line(message, prog, _options(parser))
        sys.stderr.write("\n".join([line] if line is not None else short_report(message, prog)) + "\n")
        self.exit(2)


class FedshardArgumentParser(ShortErrorParser, LightningArgumentParser):
    """Lightning's argument parser with short errors; ``--print_config`` hides secrets as the saved config does."""

    @override
    def dump(self, namespace: Namespace, *args: Any, **kwargs: Any) -> str:
        """Dump as jsonargparse does; for ``--print_config``, with every ``secret`` hidden (:func:`without_secrets`).

        Args:
            namespace: The configuration.
            *args: As jsonargparse's ``dump`` takes them.
            **kwargs: As jsonargparse's ``dump`` takes them.
        """
        if _ActionPrintConfig.is_print_config_requested(self):
            namespace = without_secrets(namespace)
        return super().dump(namespace, *args, **kwargs)


def _class_key(config: Namespace, message: str) -> str | None:
    """The config key of the class a jsonargparse instantiation message names (``trainer.strategy``)."""
    given = _GIVEN_CLASS.search(message)
    if given is None:
        return None
    return next(
        (
            key.removesuffix(".class_path")
            for key in config.keys()
            if key.endswith(".class_path") and config.get(key) == given["path"]
        ),
        None,
    )


def _parameter_class(cls: type, name: str) -> type | None:
    """The one class that parameter ``name`` of ``cls`` (or of a class its ``**kwargs`` reach) takes, if only one."""
    for owner in cls.__mro__:
        init = vars(owner).get("__init__")
        if init is None or name not in inspect.signature(init).parameters:
            continue
        hint = typing.get_type_hints(init).get(name)
        classes = [t for t in (typing.get_args(hint) or (hint,)) if isinstance(t, type) and t is not type(None)]
        return classes[0] if len(classes) == 1 else None
    return None


def _class_of(value: Any) -> type | None:
    """The class a parsed value names: a ``class_path``, a class path alone, or a registered strategy name."""
    if isinstance(value, Namespace):
        value = value.get("class_path")
    if not isinstance(value, str):
        return None
    if value in StrategyRegistry:
        return StrategyRegistry[value]["strategy"]
    module, _, name = value.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def nested_class_help(parser: LightningArgumentParser, args: list[str]) -> str | None:
    """The help of an argument's own class asked for as ``--trainer.strategy.elastic.help``, or ``None``.

    jsonargparse lists ``--<key>.<name>.help`` for an argument of a class given by ``class_path`` whose type is a
    single class (``elastic: Elastic | None``), but parses such an option only as ``--<key>.<name>`` followed by a
    value: the help it advertises would be refused. This answers it: the rest of the command line names the class at
    ``<key>``, whose ``<name>`` argument's class is listed with its fields, as ``--<key>.<name>.<field>``.
    """
    for i, arg in enumerate(args):
        match = _NESTED_HELP.fullmatch(arg)
        if match is None or (i + 1 < len(args) and not args[i + 1].startswith("-")):
            continue
        # Private jsonargparse keyword (stable since 4.0): read the class path without requiring e.g. `--model`.
        config = parser.parse_args([*args[:i], *args[i + 1 :]], _skip_validation=True)
        subcommand = config.get("subcommand")
        owner = _class_of((config[subcommand] if subcommand else config).get(match["key"]))
        cls = _parameter_class(owner, match["name"]) if owner is not None else None
        if cls is None or not dataclasses.is_dataclass(cls):
            return None
        option = f"--{match['key']}.{match['name']}"
        helper = ArgumentParser(prog=parser.prog, description=f"Help for {option}={cls.__module__}.{cls.__name__}")
        helper.add_class_arguments(cls, f"{match['key']}.{match['name']}")
        return helper.format_help()
    return None


class FedshardCLI(LightningCLI):
    """LightningCLI that reports a value refused while building the classes as a command-line error."""

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse as LightningCLI does; first answer a ``--<key>.<name>.help`` that jsonargparse advertises but refuses.

        Args:
            parser: The parser.
            args: The command line (default: ``sys.argv[1:]``), a list or a dict.
        """
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list) and (text := nested_class_help(parser, argv)) is not None:
            sys.stdout.write(text)
            raise SystemExit(0)
        super().parse_arguments(parser, args)

    @override
    def instantiate_classes(self) -> None:
        """Build the configured classes; a constructor's ``ValueError`` ends the command like a parsing error."""
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as error:
            parser = self._parser(self.subcommand)
            config = self.config if self.subcommand is None else self.config[self.subcommand]
            message = str(error)
            if (key := _class_key(config, message)) is not None:
                message = f'Parser key "{key}":\n' + "\n".join(f"  {line}" for line in message.splitlines())
            parser.error(message, error)


#: What a saved configuration shows in place of a secret (``Elastic(secret=...)``).
HIDDEN = "<hidden>"


def without_secrets(config: Namespace) -> Namespace:
    """A copy of ``config`` whose values named ``secret`` (a federation's) read :data:`HIDDEN`."""
    shown = config.clone()
    for key in list(shown.keys()):
        if key.rsplit(".", 1)[-1] == "secret" and shown[key] is not None:
            shown[key] = HIDDEN
    return shown


class SaveConfigWithoutSecrets(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` in the log folder, with every ``secret`` hidden (it is never written)."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = self.config
        self.config = without_secrets(config)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.config = config


def cli(args: ArgsType = None, run: bool = True, **kwargs: Any) -> LightningCLI:
    """Build the LightningCLI (any LightningModule / LightningDataModule, given by ``class_path``).

    Args:
        args: Command-line arguments (default: ``sys.argv[1:]``), a list or a dict as LightningCLI accepts.
        run: Run the subcommand (``fit``, ``validate``, ...) instead of only instantiating the classes.
        **kwargs: Passed on to :class:`~lightning.pytorch.cli.LightningCLI`; ``parser_kwargs={"exit_on_error":
            False}`` raises a :class:`jsonargparse.ArgumentError` instead of exiting.
    """
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    kwargs.setdefault("save_config_callback", SaveConfigWithoutSecrets)
    kwargs.setdefault("parser_class", FedshardArgumentParser)
    return FedshardCLI(args=args, run=run, **kwargs)
