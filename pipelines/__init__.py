"""Diffusers-style pipelines (installed as ``mmspec.pipelines``); one file per pipeline."""
