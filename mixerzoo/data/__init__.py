from .icr import ICRDataModule, basic_icr, positional_icr, value_token_accuracy  # noqa: F401
