from gpuflow.cli import main

raise SystemExit(main())
