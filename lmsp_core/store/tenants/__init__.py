"""Who uses the service: bearer tokens and the principals they act for (``credentials``), and
what an operator set on a principal (``principals``)."""
