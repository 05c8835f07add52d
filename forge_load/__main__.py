from forge_load.cli import main

raise SystemExit(main())
