from autosp_tools.bench.cli import main

main()
