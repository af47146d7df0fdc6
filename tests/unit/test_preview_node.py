"""ToMAPreview draws tiles, destinations and assignments over a picture."""

import pytest
import torch

from toma_pack.nodes.preview_node import palette, render_preview, token_features

OUTER = "16px (SDXL outer, Flux)"


def picture(height=256, width=256):
    y = torch.linspace(0, 1, height).view(-1, 1, 1)
    x = torch.linspace(0, 1, width).view(1, -1, 1)
    rgb = torch.cat([y.expand(height, width, 1), x.expand(height, width, 1),
                     (x * y).expand(height, width, 1)], -1)
    return rgb.unsqueeze(0).clamp(0, 1) * 0.8 + 0.1


def render(image, ratio=0.5, tiles=4, level=OUTER):
    return render_preview(image, ratio, tiles, level)


def test_shape_range_and_batch_kept():
    image = torch.cat([picture(200, 328), picture(200, 328).flip(1)])
    out = render(image)
    assert out.shape == image.shape
    assert out.min() >= 0 and out.max() <= 1


def test_tile_borders_are_white_lines():
    out = render(picture(), tiles=4)                 # 16x16 tokens, 2x2 tiles of 8x8
    assert torch.all(out[0, 128] == 1) and torch.all(out[0, :, 128] == 1)
    assert not torch.all(out[0, 64] == 1)


def test_merging_fewer_colours_than_tokens():
    """Tokens tinted by their destination: at ratio 0.75 a tile shows at most k tints."""
    image = picture()
    plain = render(image, ratio=0.0)
    merged = render(image, ratio=0.75)
    overlay = merged - 0.55 * image.float()
    cells = overlay[0, 4::16, 4::16].reshape(-1, 3)  # one pixel inside each 16px cell
    top_left = overlay[0, 4:128:16, 4:128:16].reshape(-1, 3)
    assert not torch.equal(plain, merged)
    # k = 16 destinations in this tile: at most 16 tints, each also in a darker shade
    assert len(torch.unique(top_left.round(decimals=2), dim=0)) <= 2 * 16
    # the other three tiles have tints of their own: measured 106 of at most 4 * 2 * 16
    assert 2 * 16 < len(torch.unique(cells.round(decimals=2), dim=0)) <= 4 * 2 * 16


def test_features_and_palette():
    feats, h, w = token_features(picture(100, 70)[0], 16)
    assert (h, w) == (7, 5) and feats.shape == (1, 35, 48)
    # features are centred: largest |mean| measured 6.0e-8 (float32 rounding); bound x 1.7
    assert torch.allclose(feats.mean(1), torch.zeros(48), rtol=0, atol=1e-7)
    colours = palette(torch.arange(50))
    assert colours.shape == (50, 3) and len(torch.unique(colours, dim=0)) == 50


@pytest.mark.parametrize("args, message", [
    ((0.5, 4, "nope"), "level must be one of"),
    ((1.5, 4, OUTER), "ratio must be between 0.0 and 0.9, got 1.5"),
    ((float("nan"), 4, OUTER), "ratio must be a number, got nan"),
    ((0.5, -1, OUTER), "tile_count must be between 1 and 4096, got -1"),
    ((0.5, 0, OUTER), "tile_count must be between 1 and 4096, got 0"),
    ((0.5, 10**9, OUTER), "tile_count must be between 1 and 4096, got 1000000000"),
    ((0.5, 4.0, OUTER), "tile_count must be a whole number, got 4.0"),
    ((0.5, True, OUTER), "tile_count must be a whole number, got True"),
])
def test_bad_input_names_the_widget(args, message):
    with pytest.raises(ValueError) as err:
        render_preview(picture(64, 64), *args)
    assert str(err.value).startswith(message), str(err.value)
