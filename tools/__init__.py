"""Install and maintenance tools, run from the repository root (`python -m tools.check_user_install`,
`tools/build_libllama.sh`, `tools/refresh_lock.sh`); not part of the installed package."""
