"""Reading recipes: the built-in ones shipped as package data, or any YAML file, parsed strictly."""

from __future__ import annotations

from pathlib import Path

from qtk.bounds import MAX_YAML_BYTES, load_yaml, read_text
from qtk.errors import UsageError
from qtk.recipe.schema import Recipe, parse_recipe

# package data (qtk/data/recipes), so a wheel install has them too
RECIPES_DIR = Path(__file__).resolve().parent.parent / "data" / "recipes"


class _DuplicateKey(Exception):
    def __init__(self, key, line: int):
        self.key, self.line = key, line


def _strict_loader():
    """yaml.SafeLoader that refuses a key repeated in one mapping (SafeLoader keeps the last one silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may be overridden on purpose
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
                except TypeError:  # unhashable key: SafeLoader reports it below
                    pass
            return super().construct_mapping(node, deep=deep)

    return Loader


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in recipe by name, or any YAML file by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if p.is_dir():
            raise UsageError(f"recipe {p} is a directory", "give a path to a YAML file or a built-in name (qtk recipes list)")
        if not p.is_file():
            raise UsageError(f"recipe file {p} does not exist", "give a path to a YAML file or a built-in name (qtk recipes list)")
        path = p
    else:
        known = builtin_recipes()
        if str(name_or_path) not in known:
            raise UsageError(f"unknown recipe {str(name_or_path)!r}", f"built-in recipes: {', '.join(known)}; or give a path to a YAML file")
        path = known[str(name_or_path)]
    try:
        text = read_text(path, MAX_YAML_BYTES, f"recipe {path.name}", "a recipe is a few lines of YAML: give the right file")
    except UnicodeDecodeError as e:
        raise UsageError(f"recipe {path.name} is not UTF-8 text (byte {e.start})", "re-save it as UTF-8 YAML") from None
    return parse_recipe_text(text, path.name)


def parse_recipe_text(text: str, origin: str) -> Recipe:
    """A recipe from its YAML text (a file's, or the one a checkpoint's qtk.json records): keys given twice and
    aliases that expand past qtk.bounds.MAX_YAML_NODES are refused, like the schema's errors, naming `origin`."""
    import yaml

    try:
        doc = load_yaml(text, f"recipe {origin}", _strict_loader())
    except _DuplicateKey as e:
        raise UsageError(f"recipe {origin}: key {e.key!r} appears twice in one mapping (line {e.line})",
                         "keep one; YAML would silently use the last") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"recipe {origin}: not valid YAML{at}", "fix the syntax (indentation, colons, brackets)") from None
    return parse_recipe(doc, text=text, origin=origin)
