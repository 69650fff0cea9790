"""The Hydra config tree, shipped as package data: `dsv4` composes it as `pkg://dsv4.configs`, and a project
that depends on dsv4 composes it the same way (`hydra.initialize_config_module("dsv4.configs")`, or
`dsv4.compose`). A package, not a plain folder, because Hydra reads a config module only from a package."""
