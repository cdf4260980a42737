"""The public API as a type checker reads it (mypy and pyright are not test dependencies: the checks read the
source and the annotations the checkers read)."""

import ast
import inspect
from pathlib import Path

import k6serve


def _statically_bound(tree: ast.Module) -> set[str]:
    """Names an import binds at module level or under `if typing.TYPE_CHECKING:`, as a checker sees them."""
    names: set[str] = set()
    for node in tree.body:
        body = node.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else [node]
        if isinstance(node, ast.If) and ast.unparse(node.test).startswith("not "):
            continue
        for item in body:
            if isinstance(item, (ast.Import, ast.ImportFrom)):
                names.update(alias.asname or alias.name for alias in item.names)
    return names


def test_every_exported_name_is_visible_to_type_checkers():
    # DiffGenerator came only through the module's lazy __getattr__, so mypy and pyright typed it (and every
    # result a generator returns) as Any: no error was ever caught.
    tree = ast.parse(Path(inspect.getfile(k6serve)).read_text())
    assert set(k6serve.__all__) <= _statically_bound(tree)
    for name in k6serve.__all__:
        assert getattr(k6serve, name).__module__.startswith("k6serve.")


def test_diffgenerator_decorators_keep_the_method_types():
    # Annotated `Callable -> Callable`, they made set_lora, merge_lora_weights and the other decorated methods
    # `(*Any, **Any) -> Any` to mypy and pyright: a misspelled keyword or a wrong type went unseen.
    import typing

    from k6serve import api

    for decorator in (api._in_callers_words, api._http_names_answered, api._sglang_order_answered):
        hints = typing.get_type_hints(decorator)
        assert isinstance(hints["return"], typing.TypeVar) and hints["method"] is hints["return"], decorator


def test_public_methods_are_fully_annotated():
    # An unannotated return (the `variant` property) or a bare `dict` is Any, or dict[Any, Any], to a checker.
    import typing

    from k6serve import DiffGenerator

    for name, member in vars(DiffGenerator).items():
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not callable(function):
            continue
        hints = typing.get_type_hints(inspect.unwrap(function))
        assert "return" in hints, name
        assert hints["return"] is not dict, name
