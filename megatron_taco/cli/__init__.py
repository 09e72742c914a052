import argparse

from megatron_taco.arguments import add_dataclass_args, program_name


def tool_parser(
    script: str, doc: str, *groups: tuple[type, str], **kwargs
) -> argparse.ArgumentParser:
    """A tool's parser: the name it was started by, the first paragraph of ``doc`` as its
    description, and an argument group per (config dataclass, title)."""
    description = doc.split("\n\n")[0].replace("\n", " ")
    parser = argparse.ArgumentParser(prog=program_name(script), description=description, **kwargs)
    for cls, title in groups:
        add_dataclass_args(parser, cls, title)
    return parser
