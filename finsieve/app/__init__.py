"""The application: the `finsieve` command, its server assembly and the Python client."""
