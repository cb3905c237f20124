"""`netquant` command line: quantize, platforms, demo, doctor."""

from __future__ import annotations

import click

from netquant import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="netquant")
def cli() -> None:
    """Quantize neural networks (FP32 -> INT8 / INT4 / FP8) for real inference engines."""


def _register() -> None:
    from netquant.cli.demo_cmd import demo
    from netquant.cli.doctor_cmd import doctor
    from netquant.cli.platforms_cmd import platforms
    from netquant.cli.quantize_cmd import quantize

    cli.add_command(quantize)
    cli.add_command(platforms)
    cli.add_command(demo)
    cli.add_command(doctor)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="netquant")


if __name__ == "__main__":  # pragma: no cover
    main()
