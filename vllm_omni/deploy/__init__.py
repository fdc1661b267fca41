"""Bundled deploy configs (spec 001 format); a package so the YAML files ship in wheels."""
