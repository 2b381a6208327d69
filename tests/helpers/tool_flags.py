"""A command-line tool's flags parsed by its own argparse parser, the tool stopped before it runs."""

import argparse
import importlib
import importlib.util
import re

from tests.helpers.runs import ROOT


class Parsed(Exception):
    """Raised in place of running a tool once its flags have parsed."""


def parsed_flags(module: str, flags: list[str], monkeypatch) -> argparse.Namespace:
    """What `python -m module *flags` parses its flags into (its main's parser; a package's
    __main__ names the module whose main it calls); the tool itself does not run. A flag it refuses
    raises SystemExit, as on the command line."""
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations:
        entry = (ROOT / spec.submodule_search_locations[0] / "__main__.py").read_text()
        module = re.search(r"^from (\S+) import main$", entry, flags=re.M).group(1)
    parse, parsed = argparse.ArgumentParser.parse_args, []

    def parse_only(self, args=None, namespace=None):
        parsed.append(parse(self, args, namespace))
        raise Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        try:
            importlib.import_module(module).main(flags)
        except Parsed:
            return parsed[-1]
    raise AssertionError(f"{module}'s main returned without parsing its flags")
