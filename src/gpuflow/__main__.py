from gpuflow.interface.cli.main import main

raise SystemExit(main())
