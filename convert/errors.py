"""The converter's one error type: what a user did wrong or what is wrong with the input, said plainly."""


class ConvertError(ValueError):
    """A conversion that cannot be done as asked (bad input checkpoint, options or output path)."""
