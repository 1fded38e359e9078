"""``transformer_engine.pytorch.attention``: a module with flash-attn globals up to TE 2.1, a package from 2.3."""

from transformer_engine.pytorch import flash_view

if flash_view.TE < (2, 2):
    from packaging.version import Version as PkgVersion

    _flash_attn_version = PkgVersion(flash_view.FLASH or "0")
    _flash_attn_version_required = PkgVersion(flash_view.REQUIRED)
    _flash_attn_max_version = PkgVersion(flash_view.MAX)
    if flash_view.TE >= (1, 12):
        _flash_attn_is_installed = flash_view.IN_RANGE
        _flash_attn_3_is_installed = flash_view.FA3
    else:
        _flash_attn_3_plus = flash_view.FA3
