"""Source text as a trace value."""


class Code(str):
    """Already-generated Python source, printed as is (inside containers, say)."""
