"""Ship ``llamafactory_qwenvl_patch.pth`` into site-packages for both regular and editable installs."""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH = "llamafactory_qwenvl_patch.pth"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data.setdefault(key, {})[PTH] = PTH
