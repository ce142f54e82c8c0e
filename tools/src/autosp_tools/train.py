"""Placeholder replaced by the training CLI."""


def main() -> None:
    print("autosp-train: under construction")
