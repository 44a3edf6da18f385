# Glint360K (web-crawled, not cleaned by hand), IResNet-100: the recipe for noisy labels
# (docs/noisy_labels.md). Stage 1, this config: sub-center ArcFace, 3 centers per class.
# Stage 2: python -m partial_fc_mx clean work_dirs/glint360k_r100_noisy data/glint360k_clean \
#     --rec /train_tmp/glint360k --gpu      (under mpirun -np N for the 17M images)
# Stage 3: the plain config on what it kept:
#     ... bash config.sh rec=data/glint360k_clean num_classes=<classes_kept in
#     data/glint360k_clean/clean_report.json> num_subcenters=1   (CONFIG=configs/glint360k_r100.py)
_base_ = "glint360k_r100.py"
num_subcenters = 3
