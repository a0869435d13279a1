"""A run: its state (:mod:`.state`), set-up (:mod:`.setup`), the loop read top to bottom (:mod:`.loop`), one
step's parts (:mod:`.step`), backups and the result (:mod:`.checkpoint`), samples (:mod:`.sampling`), the run
folder (:mod:`.run_folder`) and its lock (:mod:`.runlock`), the EMA copy (:mod:`.ema`) and compiled blocks
(:mod:`.compile`)."""
