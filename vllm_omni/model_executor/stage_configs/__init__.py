"""Bundled legacy stage configs (spec 000 stage_args format); a package so the YAML files ship in wheels."""
