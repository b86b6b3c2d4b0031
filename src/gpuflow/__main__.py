from gpuflow.interface.cli import main

raise SystemExit(main())
